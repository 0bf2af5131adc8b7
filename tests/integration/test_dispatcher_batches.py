"""The row-reaper's batches as `lapse up` runs them: the dispatcher hands a fetch's due
events to `RowReaper.handle_batch`, which handles them side by side; the row store's
coalescing front (lapse/edges/rows/coalesce.py) puts their runs' rows in shared
transactions, and each message is still settled on its own.

Real servers throughout: the due events are fired messages in a real NATS schedule stream
(what the scheduler leaves behind, and the proof the row-reaper reads back), the rows are
KFP's tables in PostgreSQL and MariaDB, the outage is a TCP proxy the test closes
(tests/integration/test_row_reaper.py). The store is wrapped only to record how many runs
each `delete` carried, so the tests know the batch path was the one taken.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config import NatsConfig, Streams
from lapse.edges.rows import CoalescingRowStore, open_row_store
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.builder import build_event, outcome_id, parse_payload
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed
from lapse.events.nats_binding import to_nats
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType, Outcome
from lapse.functions.row_reaper import RowReaper, RowStore
from lapse.functions.row_reaper.ports import RunResult, RunRows
from lapse.functions.row_reaper.targets import TargetSpec, kfp_target
from lapse.functions.safety import SafetyConfig
from lapse.runtime.dispatcher import BatchHandler, Dispatcher, Subscription
from lapse.runtime.outages import Backoff
from lapse.runtime.routing import Route
from lapse.telemetry.handling import instrumented
from tests import kfp_schema as kfp
from tests.integration import test_row_reaper as rows_fixtures
from tests.integration.test_row_reaper import ListEmitter, TcpProxy
from tests.stack import wait_for

pytestmark = [pytest.mark.db, pytest.mark.nats]

STREAMS = Streams()
ROUTE = Route(
    name="row-batch-due",
    function="row-reaper",
    filters={"type": EventType.CLEANUP_DUE, "target": "database"},
)
DURABLE = "lapse-row-batch-due"
# The row tests' database fixtures: the KFP tables dropped after each test, and the proxy.
engine = rows_fixtures.engine
proxied = rows_fixtures.proxied


class Recording:
    """The real row store, recording how many runs each `delete` carried."""

    def __init__(self, inner: RowStore) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return self.inner.targets

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        self.sizes.append(len(runs))
        return await self.inner.delete(runs, dry_run=dry_run)


def due(run_id: str) -> BaseCloudEvent:
    deadline = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"pipeline-{run_id[:8]}", uid=str(uuid.uuid4()),
        phase="Succeeded", labels={KFP_RUN_ID_LABEL: run_id}, kfp_run_id=run_id,
    )  # fmt: skip
    payload = CleanupDue(
        run=run, target=Target.DATABASE, deadline=deadline, policy="test", scheduled_at=deadline
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/test", data=payload)


async def fire(js: JetStreamContext, events: list[BaseCloudEvent]) -> None:
    """Each due event where the scheduler leaves it when it fires: on its due subject in
    the schedule stream, where the dispatcher reads it and the row-reaper proves it."""
    for event in events:
        message = to_nats(event)
        data = event.get_data()
        assert isinstance(data, dict)
        subject = due_subject(Target.DATABASE, data["run"]["uid"])
        await js.publish(subject, message.body, stream=STREAMS.schedule, headers=message.headers)


async def reaper(js: JetStreamContext, rows: RowStore, emitter: ListEmitter) -> RowReaper:
    return RowReaper(
        # As `lapse up` gives it (lapse/runtime/registry.py): concurrent deletes coalesce.
        rows=CoalescingRowStore(rows),
        schedules=NatsScheduleStore(js, STREAMS),
        emitter=emitter,
        safety=SafetyConfig.model_validate({"mass_deletion_brake": {"enabled": False}}),
    )


def outcomes_by_due(events: list[BaseCloudEvent], emitted: list[BaseCloudEvent]) -> dict[str, Any]:
    """Each due event's outcome, found by the id derived from the due event's; every
    outcome emitted belongs to exactly one due event."""
    wanted = {outcome_id(e.get_id(), EventType.CLEANUP_COMPLETED): e.get_id() for e in events}
    found: dict[str, CleanupCompleted] = {}
    for event in emitted:
        assert event.get_type() == EventType.CLEANUP_COMPLETED, event.get_data()
        due_id = wanted[event.get_id()]
        assert due_id not in found, "two outcomes for one due event"
        found[due_id] = parse_payload(event, CleanupCompleted)
    return found


async def settled(js: JetStreamContext) -> bool:
    info = await js.consumer_info(STREAMS.schedule, DURABLE)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_batch_of_due_events_ends_with_one_outcome_each_and_a_running_run_kept(
    lapse_streams: JetStreamContext, engine: AsyncEngine
) -> None:
    await kfp.create_kfp_tables(engine)
    finished = [str(uuid.uuid4()) for _ in range(12)]
    running, bystander = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [*finished, running, bystander])
        await conn.execute(
            kfp.run_details.update()
            .where(kfp.run_details.c["UUID"] == running)
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
    emitter = ListEmitter()
    rows = Recording(await open_row_store(engine, [kfp_target()]))
    # Wrapped as `lapse up` wraps it (lapse/runtime/registry.py): still a batch handler.
    handler = instrumented("row-reaper", await reaper(lapse_streams, rows, emitter))
    assert isinstance(handler, BatchHandler)
    events = [due(run_id) for run_id in [*finished[:6], running, *finished[6:]]]
    await fire(lapse_streams, events[:3])
    # Not a CloudEvent, inside the batch: dead-lettered by the dispatcher, the rest unharmed.
    await lapse_streams.publish(
        due_subject(Target.DATABASE, "garbage"), b"not an event", stream=STREAMS.schedule
    )
    await fire(lapse_streams, events[3:])  # all there before the first fetch: one batch

    dispatcher = Dispatcher(
        lapse_streams, emitter, NatsConfig(), [Subscription(ROUTE, handler)], batch=64
    )
    dispatching = asyncio.create_task(dispatcher.run())
    try:

        async def all_out() -> bool:
            return len(emitter.events) >= len(events) + 1 and await settled(lapse_streams)

        await wait_for(all_out, timeout=60, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(dispatching, 30)

    assert max(rows.sizes) > 1, f"the dispatcher never handed over a batch: {rows.sizes}"
    [dead] = [e for e in emitter.events if e.get_source() == "/lapse/dispatcher"]
    failed = parse_payload(dead, CleanupFailed)
    assert failed.reason.startswith("not a CloudEvent"), failed.reason
    outcomes = [e for e in emitter.events if e is not dead]
    found = outcomes_by_due(events, outcomes)
    assert len(found) == len(events) == len(outcomes)
    kept = found[events[6].get_id()]
    assert kept.outcome is Outcome.KEPT
    assert kept.run is not None and kept.run.kfp_run_id == running
    deleted = [found[e.get_id()] for i, e in enumerate(events) if i != 6]
    assert [o.outcome for o in deleted] == [Outcome.DELETED] * len(finished)
    full = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
    async with engine.connect() as conn:
        for run_id in finished:
            assert await kfp.kfp_counts(conn, run_id) == dict.fromkeys(kfp.KFP_TABLES, 0)
        assert await kfp.kfp_counts(conn, running) == full
        assert await kfp.kfp_counts(conn, bystander) == full


async def test_a_batch_waits_out_the_database_and_is_never_dead_lettered(
    lapse_streams: JetStreamContext,
    engine: AsyncEngine,
    proxied: tuple[TcpProxy, AsyncEngine],
) -> None:
    proxy, through = proxied
    await kfp.create_kfp_tables(engine)
    run_ids = [str(uuid.uuid4()) for _ in range(8)]
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, run_ids)
    emitter = ListEmitter()
    rows = Recording(await open_row_store(through, [kfp_target()]))
    handler = await reaper(lapse_streams, rows, emitter)
    events = [due(run_id) for run_id in run_ids]
    await fire(lapse_streams, events)
    proxy.cut()
    # Two tries would dead-letter a bug: the outage outlasts them and must not be.
    dispatcher = Dispatcher(
        lapse_streams,
        emitter,
        NatsConfig(max_deliver=2),
        [Subscription(ROUTE, handler)],
        backoff=Backoff(first=0.2, cap=0.5),
    )
    dispatching = asyncio.create_task(dispatcher.run())
    try:

        async def tried_thrice() -> bool:
            return len(rows.sizes) >= 3

        await wait_for(tried_thrice, timeout=60, interval=0.1)
        assert dispatcher.outages.describe(asyncio.get_running_loop().time())
        assert emitter.events == [], "nothing decided while the database is away"
        async with engine.connect() as conn:
            assert (await kfp.kfp_total(conn))["run_details"] == len(run_ids)

        await proxy.open()

        async def all_out() -> bool:
            return len(emitter.events) >= len(events) and await settled(lapse_streams)

        await wait_for(all_out, timeout=60, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(dispatching, 30)

    assert max(rows.sizes) > 1, f"the dispatcher never handed over a batch: {rows.sizes}"
    found = outcomes_by_due(events, emitter.events)  # no cleanup.failed among them
    assert [found[e.get_id()].outcome for e in events] == [Outcome.DELETED] * len(events)
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == dict.fromkeys(kfp.KFP_TABLES, 0)
