"""ttl-planner against a real NATS server: deadlines become message schedules that fire."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from lapse.config import Streams
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupDue, CleanupFailed, RunDeleted, RunFinished
from lapse.events.nats_binding import from_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import schedule_subject
from lapse.events.types import EventType
from lapse.functions.policy import Policy
from lapse.functions.trust import Trust
from lapse.functions.ttl_planner import Planner

STREAMS = Streams()


@dataclass
class Bus:
    js: JetStreamContext

    def planner(self, policies: list[dict[str, Any]] | None = None) -> Planner:
        return Planner(
            schedules=NatsScheduleStore(self.js, STREAMS),
            emitter=NatsEmitter(self.js, STREAMS),
            policies=[Policy.model_validate(p) for p in policies or []],
        )

    async def due_reader(self) -> Any:
        return await self.js.pull_subscribe(
            "lapse.due.>",
            durable=f"due-{uuid.uuid4().hex[:8]}",
            stream=STREAMS.schedule,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )

    async def collect_due(self, sub: Any, window: float) -> list[tuple[datetime, CleanupDue]]:
        """Every due message arriving within `window` seconds, with its arrival time."""
        got: list[tuple[datetime, CleanupDue]] = []
        end = asyncio.get_running_loop().time() + window
        while (left := end - asyncio.get_running_loop().time()) > 0:
            try:
                msgs = await sub.fetch(100, timeout=min(left, 1.0))
            except TimeoutError:
                continue
            now = datetime.now(UTC)
            for m in msgs:
                got.append((now, parse_payload(from_nats(m.headers, m.data), CleanupDue)))
                await m.ack()
        return got


@pytest.fixture
async def bus(lapse_streams: JetStreamContext) -> Bus:
    return Bus(lapse_streams)


def run(
    *,
    annotations: dict[str, str] | None = None,
    finished: datetime | None = None,
    uid: str | None = None,
) -> RunRef:
    return RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="team-a",
        name="wf-" + uuid.uuid4().hex[:6],
        uid=uid or str(uuid.uuid4()),
        phase="Succeeded",
        finished_at=finished or datetime.now(UTC),
        annotations=annotations or {},
    )


def finished(r: RunRef) -> Any:
    return build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=r))


def deleted(r: RunRef) -> Any:
    return build_event(EventType.RUN_DELETED, source="/test", data=RunDeleted(run=r))


async def test_deadline_fires_on_due_subject(bus: Bus) -> None:
    sub = await bus.due_reader()
    r = run(annotations={"lapse.dev/ttl": "2s"})
    emitted = await bus.planner().handle(finished(r), Trust.OBSERVED)
    assert [e.get_type() for e in emitted] == [EventType.CLEANUP_SCHEDULED]  # database: never

    arrivals = await bus.collect_due(sub, window=6)
    assert len(arrivals) == 1
    arrived, due = arrivals[0]
    assert (due.run.uid, due.target) == (r.uid, Target.KUBERNETES)
    assert due.deadline == r.finished_at + timedelta(seconds=2)
    assert due.policy == "annotation:lapse.dev/ttl"
    lateness = (arrived - due.deadline).total_seconds()
    print(f"\nplanner schedule lateness: {lateness * 1000:.0f} ms")
    assert 0 <= lateness < 3


async def test_changed_ttl_fires_once_at_the_new_time(bus: Bus) -> None:
    sub = await bus.due_reader()
    start = datetime.now(UTC)
    r = run(annotations={"lapse.dev/ttl": "2s"}, finished=start)
    planner = bus.planner()
    await planner.handle(finished(r), Trust.OBSERVED)
    moved = r.model_copy(update={"annotations": {"lapse.dev/ttl": "4s"}})
    emitted = await planner.handle(finished(moved), Trust.OBSERVED)
    assert len(emitted) == 1
    assert parse_payload(emitted[0]).replaced is True  # type: ignore[union-attr]

    arrivals = await bus.collect_due(sub, window=7)
    assert len(arrivals) == 1
    arrived, due = arrivals[0]
    assert due.deadline == start + timedelta(seconds=4)
    assert arrived >= start + timedelta(seconds=4)


@pytest.mark.parametrize(
    ("second", "policies"),
    [
        ({"lapse.dev/ttl": "2s", "lapse.dev/keep": "true"}, []),
        ({}, [{"name": "forever", "kubernetes": {"ttl": "never"}}]),
    ],
    ids=["keep", "never"],
)
async def test_keep_and_never_cancel(
    bus: Bus, second: dict[str, str], policies: list[dict[str, Any]]
) -> None:
    sub = await bus.due_reader()
    r = run(annotations={"lapse.dev/ttl": "2s"})
    await bus.planner().handle(finished(r), Trust.OBSERVED)
    emitted = await bus.planner(policies).handle(
        finished(r.model_copy(update={"annotations": second})), Trust.OBSERVED
    )
    assert [e.get_type() for e in emitted] == [EventType.CLEANUP_CANCELLED]
    assert await bus.collect_due(sub, window=4) == []


async def test_run_deleted_cancels_only_the_kubernetes_deadline(bus: Bus) -> None:
    sub = await bus.due_reader()
    policies = [{"name": "both", "kubernetes": {"ttl": "3s"}, "database": {"ttl": "3s"}}]
    r = run()
    planner = bus.planner(policies)
    emitted = await planner.handle(finished(r), Trust.OBSERVED)
    assert sorted(parse_payload(e).target for e in emitted) == ["database", "kubernetes"]  # type: ignore[union-attr]
    cancelled = await planner.handle(deleted(r), Trust.OBSERVED)
    assert [parse_payload(e).target for e in cancelled] == [Target.KUBERNETES]  # type: ignore[union-attr]

    arrivals = await bus.collect_due(sub, window=6)
    assert [(d.run.uid, d.target) for _, d in arrivals] == [(r.uid, Target.DATABASE)]


async def test_duplicate_finish_creates_no_second_schedule(bus: Bus) -> None:
    sub = await bus.due_reader()
    r = run(annotations={"lapse.dev/ttl": "2s"})
    planner = bus.planner()
    event = finished(r)
    assert len(await planner.handle(event, Trust.OBSERVED)) == 1
    assert await planner.handle(event, Trust.OBSERVED) == []  # redelivery
    assert (
        await planner.handle(finished(r), Trust.OBSERVED) == []
    )  # a re-list produces a new event id
    info = await bus.js.stream_info(
        STREAMS.schedule, subjects_filter=schedule_subject(Target.KUBERNETES, r.uid)
    )
    assert info.state.messages == 1
    assert len(await bus.collect_due(sub, window=5)) == 1


async def test_invalid_input_goes_to_the_dead_letter_stream(bus: Bus) -> None:
    from cloudevents.core.v1.event import CloudEvent

    bogus = CloudEvent(
        {
            "type": "dev.knative.apiserver.resource.update",
            "source": "/apis/v1",
            "id": "x1",
            "specversion": "1.0",
        },
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "no-uid"}},
    )
    emitted = await bus.planner().handle(bogus)
    assert [e.get_type() for e in emitted] == [EventType.CLEANUP_FAILED]
    dlq = await bus.js.pull_subscribe("lapse.dlq.>", durable="dlq-reader", stream=STREAMS.dlq)
    msgs = await dlq.fetch(1, timeout=5)
    failed = parse_payload(from_nats(msgs[0].headers, msgs[0].data), CleanupFailed)
    assert failed.stage == "planner"
    assert "uid" in failed.reason
    assert failed.original is not None and failed.original.attributes["id"] == "x1"


async def test_ten_thousand_runs_all_fire_once(bus: Bus) -> None:
    sub = await bus.due_reader()
    planner = bus.planner()
    start = datetime.now(UTC)
    runs = [run(annotations={"lapse.dev/ttl": "3s"}, finished=start) for _ in range(10_000)]
    for i in range(0, len(runs), 250):
        await asyncio.gather(
            *(planner.handle(finished(r), Trust.OBSERVED) for r in runs[i : i + 250])
        )
    planned = datetime.now(UTC)
    print(f"\nplanned 10,000 runs in {(planned - start).total_seconds():.1f} s")

    seen: dict[str, int] = {}
    deadline = start + timedelta(seconds=3)
    early = 0
    end = asyncio.get_running_loop().time() + 120
    while len(seen) < len(runs) and asyncio.get_running_loop().time() < end:
        for arrived, due in await bus.collect_due(sub, window=1):
            seen[due.run.uid] = seen.get(due.run.uid, 0) + 1
            early += arrived < deadline
    # A few more seconds, so a duplicate firing would show up.
    for _, due in await bus.collect_due(sub, window=2):
        seen[due.run.uid] = seen.get(due.run.uid, 0) + 1
    assert set(seen) == {r.uid for r in runs}
    assert set(seen.values()) == {1}
    assert early == 0


async def test_replanning_after_the_deadline_fired_issues_no_second_due(bus: Bus) -> None:
    sub = await bus.due_reader()
    r = run(annotations={"lapse.dev/ttl": "1s"})
    planner = bus.planner()
    await planner.handle(finished(r), Trust.OBSERVED)
    assert len(await bus.collect_due(sub, window=3)) == 1
    # The watcher re-lists (a restart) while the reaper is still behind: same run again.
    assert await planner.handle(finished(r), Trust.OBSERVED) == []
    assert await bus.collect_due(sub, window=2) == []
    # A changed TTL still re-plans.
    moved = r.model_copy(update={"annotations": {"lapse.dev/ttl": "2s"}})
    assert len(await planner.handle(finished(moved), Trust.OBSERVED)) == 1


async def test_a_run_without_finished_at_keeps_its_first_deadline(bus: Bus) -> None:
    """Seen again (a re-list, an update), a run that has no finishedAt keeps the deadline
    it got when first seen; it is not pushed on by each sighting."""
    r = run(annotations={"lapse.dev/ttl": "1h"}).model_copy(update={"finished_at": None})
    first_seen = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
    planner = bus.planner()
    first = Planner(planner.schedules, planner.emitter, clock=lambda: first_seen)
    later = Planner(
        planner.schedules, planner.emitter, clock=lambda: first_seen + timedelta(minutes=7)
    )
    produced = await first.handle(finished(r), Trust.OBSERVED)
    scheduled = [parse_payload(e) for e in produced if e.get_type() == EventType.CLEANUP_SCHEDULED]
    assert [s.deadline for s in scheduled] == [first_seen + timedelta(hours=1)]  # type: ignore[union-attr]
    assert await later.handle(finished(r), Trust.OBSERVED) == []
    pending = await planner.schedules.get(Target.KUBERNETES, r.uid)
    assert pending is not None and pending.deadline == first_seen + timedelta(hours=1)
