"""The object reaper on Argo Workflows, against a real kube-apiserver (Argo's Workflow CRD)
and a real NATS server.

Workflows are written the way Argo writes them (status with the object, the controller's
labels); the due event is the one the planner would have scheduled. Two pass-through
wrappers around the real `Workflows` appear below: one counts API requests, one writes to
the object between the reaper's GET and DELETE (a real 409 from the real server). The only
fake is a single synthetic 503, which a healthy test server cannot be made to return.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cloudevents.core.base import BaseCloudEvent
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from lapse.config import Streams
from lapse.edges.kubernetes import (
    ApiCallFailure,
    KubeEvents,
    KubeObjects,
    Workflows,
    load_api_client,
)
from lapse.edges.kubernetes.reaping import ReapedObjects, failure_of
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.kube import READONLY_USER
from lapse.embedded.process import free_port
from lapse.events.adapters import adapt_workflow
from lapse.events.builder import build_event, parse_payload
from lapse.events.kinds import ARGO_WORKFLOW, KindSpec
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed, RunFinished
from lapse.events.nats_binding import from_nats
from lapse.events.observed import API_SERVER, OBSERVED_HEADER
from lapse.events.run import Target
from lapse.events.schemas import load_schema
from lapse.events.subjects import due_subject, schedule_subject
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper import SOURCE, ObjectAccess, ObjectReaper
from lapse.functions.ports import RetryLater
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Provenance, Trust
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import ARCHIVING, argo_workflow

STREAMS = Streams()
TTL = "10m"


# --- fixtures and helpers ---------------------------------------------------------------


@dataclass
class Bus:
    js: JetStreamContext

    @property
    def schedules(self) -> NatsScheduleStore:
        return NatsScheduleStore(self.js, STREAMS)

    async def due_reader(self, uid: str) -> Any:
        return await self.js.pull_subscribe(
            due_subject(Target.KUBERNETES, uid),
            durable=f"due-{uuid.uuid4().hex[:8]}",
            stream=STREAMS.schedule,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )

    async def next_due(self, sub: Any, timeout: float = 15) -> BaseCloudEvent:
        """The next due event the NATS scheduler fires, as a CloudEvent."""
        msgs = await sub.fetch(1, timeout=timeout)
        await msgs[0].ack()
        return from_nats(msgs[0].headers, msgs[0].data)

    async def stored(self, stream: str, subject: str) -> list[BaseCloudEvent]:
        sub = await self.js.pull_subscribe(
            subject, durable=f"read-{uuid.uuid4().hex[:8]}", stream=stream
        )
        try:
            msgs = await sub.fetch(100, timeout=2)
        except TimeoutError:
            return []
        return [from_nats(m.headers, m.data) for m in msgs]


@pytest.fixture
def bus(lapse_streams: JetStreamContext) -> Bus:
    return Bus(lapse_streams)


NAMESPACE_PREFIX = "reaper-"


@pytest.fixture(autouse=True)
def leave_no_workflows(kube: KubeStack) -> Iterator[None]:
    """The apiserver is shared by the session (a watcher test lists every Workflow): remove
    what these tests leave behind. Namespaces stay; nothing here can finish deleting them."""
    yield
    custom = client.CustomObjectsApi(kube.api_client)
    core = client.CoreV1Api(kube.api_client)
    for namespace in core.list_namespace().items:
        name = namespace.metadata.name
        if name.startswith(NAMESPACE_PREFIX):
            custom.delete_collection_namespaced_custom_object(
                "argoproj.io", "v1alpha1", name, "workflows"
            )
            core.delete_collection_namespaced_event(name)


@dataclass
class Calls:
    """Pass-through to the real API server that counts requests (no behaviour changed)."""

    inner: Workflows
    gets: int = 0
    deletes: int = 0
    lists: int = 0

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        self.gets += 1
        return await ReapedObjects(self.inner.objects).get(
            kind, namespace, name, request_timeout=request_timeout
        )

    async def delete(self, kind: KindSpec, namespace: str, name: str, **kwargs: Any) -> None:
        self.deletes += 1
        await ReapedObjects(self.inner.objects).delete(kind, namespace, name, **kwargs)

    async def list_items(
        self, kind: KindSpec, namespace: str, **kwargs: Any
    ) -> list[dict[str, Any]]:
        self.lists += 1
        return await ReapedObjects(self.inner.objects).list_items(kind, namespace, **kwargs)


@dataclass
class Meddling(Calls):
    """After the reaper's first GET, someone else writes the object (through the real API)."""

    meddle: Callable[[dict[str, Any]], None] = lambda obj: None
    done: bool = False

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        obj = await super().get(kind, namespace, name, request_timeout=request_timeout)
        if obj is not None and not self.done:
            self.done = True
            changed = await self.inner.get(namespace, name)
            assert changed is not None
            self.meddle(changed)
            await self.inner.replace(namespace, name, changed)
        return obj


@dataclass
class FlakyDelete(Calls):
    """FAKE, on purpose: the first DELETE answers 503 without reaching the server, because
    a healthy kube-apiserver cannot be made to return a 5xx on demand."""

    failed: bool = False

    async def delete(self, kind: KindSpec, namespace: str, name: str, **kwargs: Any) -> None:
        if not self.failed:
            self.failed = True
            # What the edge makes of a 503 (lapse/edges/kubernetes/reaping.py).
            unavailable = ApiCallFailure(503, "Service Unavailable")
            raise failure_of(unavailable, "delete", kind, namespace, name)
        await super().delete(kind, namespace, name, **kwargs)


def reaper(
    kube: KubeStack,
    bus: Bus,
    *,
    workflows: ObjectAccess | None = None,
    recorder: KubeEvents | None = None,
    **safety: Any,
) -> ObjectReaper:
    return ObjectReaper(
        objects=workflows if workflows is not None else Calls(kube.workflows),
        schedules=bus.schedules,
        emitter=NatsEmitter(bus.js, STREAMS),
        safety=SafetyConfig.model_validate(safety),
        propagation_policy="Background",
        recorder=recorder,
        request_timeout=10,
    )


async def finished_workflow(
    kube: KubeStack,
    namespace: str,
    name: str,
    *,
    finished_ago: timedelta = timedelta(minutes=20),
    annotations: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Create a Workflow the controller has already finished (TTL 10m unless told)."""
    body = argo_workflow(
        name,
        namespace=namespace,
        finished_at=datetime.now(UTC) - finished_ago,
        annotations={"lapse.dev/ttl": TTL, **(annotations or {})},
        **kwargs,
    )
    return await kube.workflows.create(namespace, body)


def due_event(obj: dict[str, Any]) -> BaseCloudEvent:
    """The due event the planner scheduled for `obj` (deadline = finishedAt + 10m)."""
    finished = adapt_workflow(obj)
    assert isinstance(finished, RunFinished) and finished.run.finished_at is not None
    deadline = finished.run.finished_at + timedelta(minutes=10)
    due = CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=deadline,
        policy="annotation:lapse.dev/ttl",
        scheduled_at=finished.run.finished_at,
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=due)


def only(events: list[BaseCloudEvent]) -> CleanupCompleted | CleanupFailed:
    """The single outcome event, checked against the published JSON Schema."""
    assert len(events) == 1, [e.get_type() for e in events]
    event = events[0]
    assert event.get_source() == SOURCE
    jsonschema.validate(event.get_data(), load_schema(event.get_type()))
    payload = parse_payload(event)
    assert isinstance(payload, CleanupCompleted | CleanupFailed)
    return payload


def completed(events: list[BaseCloudEvent], outcome: Outcome) -> CleanupCompleted:
    payload = only(events)
    assert isinstance(payload, CleanupCompleted), payload
    assert payload.outcome is outcome, payload.detail
    return payload


def failed(events: list[BaseCloudEvent]) -> CleanupFailed:
    payload = only(events)
    assert isinstance(payload, CleanupFailed), payload
    return payload


async def edit(
    kube: KubeStack, obj: dict[str, Any], change: Callable[[dict[str, Any]], None]
) -> None:
    fresh = await kube.workflows.get(obj["metadata"]["namespace"], obj["metadata"]["name"])
    assert fresh is not None
    change(fresh)
    await kube.workflows.replace(fresh["metadata"]["namespace"], fresh["metadata"]["name"], fresh)


async def exists(kube: KubeStack, obj: dict[str, Any]) -> bool:
    current = await kube.workflows.get(obj["metadata"]["namespace"], obj["metadata"]["name"])
    return current is not None and current["metadata"]["uid"] == obj["metadata"]["uid"]


# --- the deletion and its idempotency ---------------------------------------------------


async def test_expired_workflow_is_deleted_with_two_requests_and_an_event(
    kube: KubeStack, bus: Bus
) -> None:
    ns = kube.namespace("reaper-delete")
    wf = await finished_workflow(kube, ns, "expired")
    calls = Calls(kube.workflows)
    recorder = KubeEvents(kube.api_client, kube.executor, component="lapse-object-reaper")
    start = datetime.now(UTC)
    done = completed(
        await reaper(kube, bus, workflows=calls, recorder=recorder).handle(due_event(wf)),
        Outcome.DELETED,
    )
    assert not await exists(kube, wf)
    assert (calls.gets, calls.deletes) == (1, 1)  # the budget in docs/architecture.md: GET + DELETE
    assert done.run.uid == wf["metadata"]["uid"]
    assert done.completed_at >= start
    assert done.latency_seconds is not None and done.latency_seconds > 9 * 60
    audit = await bus.stored(STREAMS.audit, "lapse.audit.>")
    assert len(audit) == 1
    assert parse_payload(audit[0], CleanupCompleted).outcome is Outcome.DELETED

    core = client.CoreV1Api(kube.api_client)
    events = core.list_namespaced_event(ns).items
    mine = [e for e in events if e.involved_object.uid == wf["metadata"]["uid"]]
    assert [e.reason for e in mine] == ["LapseDeleted"]
    assert "annotation:lapse.dev/ttl" in mine[0].message


async def test_same_due_event_twice_deletes_once(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-twice")
    wf = await finished_workflow(kube, ns, "twice")
    calls = Calls(kube.workflows)
    reap = reaper(kube, bus, workflows=calls)
    event = due_event(wf)
    completed(await reap.handle(event), Outcome.DELETED)
    completed(await reap.handle(event), Outcome.ALREADY_GONE)
    assert calls.deletes == 1


@dataclass
class LostAnswer(Calls):
    """The DELETE reaches the real API server and commits, but its answer is lost on the
    way back (as when the connection drops during an etcd hiccup). A fault injected here
    because a lost response cannot be provoked on demand against a healthy server."""

    async def delete(self, kind: KindSpec, namespace: str, name: str, **kwargs: Any) -> None:
        await super().delete(kind, namespace, name, **kwargs)
        if self.deletes == 1:
            # What the edge makes of a read timeout (lapse/edges/kubernetes/reaping.py).
            lost = ApiCallFailure(None, "the server did not answer in time (i/o timeout)")
            raise failure_of(lost, "delete", kind, namespace, name)


async def test_a_delete_whose_answer_was_lost_ends_in_one_outcome(
    kube: KubeStack, bus: Bus
) -> None:
    ns = kube.namespace("reaper-lost-answer")
    wf = await finished_workflow(kube, ns, "lost-answer")
    calls = LostAnswer(kube.workflows)
    reap = reaper(kube, bus, workflows=calls)
    event = due_event(wf)
    with pytest.raises(RetryLater):
        await reap.handle(event)  # committed, but lapse cannot know: try again
    again = await reap.handle(event)
    assert not await exists(kube, wf)
    outcomes = [
        e
        for e in await bus.stored(STREAMS.audit, "lapse.audit.>")
        if e.get_type() == EventType.CLEANUP_COMPLETED
        and parse_payload(e, CleanupCompleted).run.uid == wf["metadata"]["uid"]
    ]
    assert len(outcomes) == 1
    assert outcomes[0].get_id() == again[0].get_id()
    # A later delivery of the same due event adds no second outcome either.
    await reap.handle(event)
    assert (
        len(
            [
                e
                for e in await bus.stored(STREAMS.audit, "lapse.audit.>")
                if e.get_type() == EventType.CLEANUP_COMPLETED
                and parse_payload(e, CleanupCompleted).run.uid == wf["metadata"]["uid"]
            ]
        )
        == 1
    )


async def test_the_delete_is_sent_from_the_event_loop_not_a_client_thread(
    kube: KubeStack, bus: Bus
) -> None:
    """The drain's hot path (issue 41): the DELETE goes from the event loop (loop_http.py),
    so with every thread of the Kubernetes pool busy, a due event lapse read itself
    (`OBSERVED`: judged as planned, no GET) is still deleted, held to its uid and
    resourceVersion. It used to wait for a thread. (A 409, a 404, a 403 and no server at
    all through the same path: the tests around this one.)"""
    ns = kube.namespace("reaper-loop-delete")
    wf = await finished_workflow(kube, ns, "loop-delete")
    busy, release = ThreadPoolExecutor(1), threading.Event()
    busy.submit(release.wait)
    try:
        reap = reaper(kube, bus, workflows=ReapedObjects(KubeObjects(kube.api_client, busy)))
        done = await asyncio.wait_for(reap.handle(due_event(wf), Trust.OBSERVED), 20)
        completed(done, Outcome.DELETED)
        assert not await exists(kube, wf)
    finally:
        release.set()
        busy.shutdown()


# --- step 2: identity and keep ----------------------------------------------------------


async def test_recreated_workflow_with_the_same_name_survives_the_old_deadline(
    kube: KubeStack, bus: Bus
) -> None:
    ns = kube.namespace("reaper-replaced")
    old = await finished_workflow(kube, ns, "nightly")
    stale = due_event(old)
    await kube.workflows.delete(ns, "nightly", uid=old["metadata"]["uid"])
    # A new run reuses the name; it is even expired itself, yet the old event must not touch it.
    new = await finished_workflow(kube, ns, "nightly")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    outcome = completed(await reaper(kube, bus).handle(stale), Outcome.REPLACED)
    assert outcome.run.uid == old["metadata"]["uid"]
    assert new["metadata"]["uid"] in (outcome.detail or "")
    assert await exists(kube, new)


async def test_keep_added_after_scheduling_keeps_the_workflow(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-keep")
    wf = await finished_workflow(kube, ns, "precious")
    event = due_event(wf)
    await edit(kube, wf, lambda o: o["metadata"]["annotations"].update({"lapse.dev/keep": "true"}))
    outcome = completed(await reaper(kube, bus).handle(event), Outcome.KEPT)
    assert "lapse.dev/keep" in (outcome.detail or "")
    assert await exists(kube, wf)


async def test_rerun_workflow_is_not_deleted(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-rerun")
    wf = await finished_workflow(kube, ns, "retried")
    event = due_event(wf)

    def rerun(o: dict[str, Any]) -> None:  # what `argo retry` leaves behind
        o["status"] = {"phase": "Running", "startedAt": o["status"]["startedAt"]}
        o["metadata"]["labels"].update(
            {"workflows.argoproj.io/completed": "false", "workflows.argoproj.io/phase": "Running"}
        )

    await edit(kube, wf, rerun)
    outcome = completed(await reaper(kube, bus).handle(event), Outcome.KEPT)
    assert "Running" in (outcome.detail or "")
    assert await exists(kube, wf)


# --- step 3: the policy from the fresh object -------------------------------------------


async def test_extended_ttl_reschedules_at_the_later_deadline(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-extended")
    wf = await finished_workflow(kube, ns, "extended")
    event = due_event(wf)
    await edit(kube, wf, lambda o: o["metadata"]["annotations"].update({"lapse.dev/ttl": "3h"}))

    outcome = completed(await reaper(kube, bus).handle(event), Outcome.RESCHEDULED)
    assert await exists(kube, wf)
    uid = wf["metadata"]["uid"]
    finished_at = datetime.fromisoformat(wf["status"]["finishedAt"])
    pending = await bus.schedules.get(Target.KUBERNETES, uid)
    assert pending is not None and pending.deadline == finished_at + timedelta(hours=3)
    assert "moved" in (outcome.detail or "")

    # The schedule carries a due event for the new deadline, built by the reaper.
    msg = await bus.js.get_last_msg(STREAMS.schedule, schedule_subject(Target.KUBERNETES, uid))
    new_due = parse_payload(from_nats(msg.headers, msg.data or b""), CleanupDue)
    assert new_due.deadline == finished_at + timedelta(hours=3)
    assert new_due.run.annotations["lapse.dev/ttl"] == "3h"
    # Judged on the reaper's own GET: the schedule says lapse read that version.
    assert (msg.headers or {}).get(OBSERVED_HEADER) == API_SERVER


async def test_invalid_annotation_fails_and_deletes_nothing(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-invalid")
    wf = await finished_workflow(kube, ns, "typo")
    event = due_event(wf)
    await edit(kube, wf, lambda o: o["metadata"]["annotations"].update({"lapse.dev/ttl": "3x"}))
    outcome = failed(await reaper(kube, bus).handle(event))
    assert "lapse.dev/ttl" in outcome.reason
    assert await exists(kube, wf)
    dead = await bus.stored(STREAMS.dlq, "lapse.dlq.>")
    assert [parse_payload(e, CleanupFailed).reason for e in dead] == [outcome.reason]


# --- step 4: gates ----------------------------------------------------------------------


async def test_archiving_pending_waits_until_archived(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-archiving")
    wf = await finished_workflow(kube, ns, "archived", archiving="Pending")
    uid = wf["metadata"]["uid"]
    reap = reaper(kube, bus, gate_retry={"backoff": "1s", "max_wait": "1h"})
    due = await bus.due_reader(uid)

    outcome = completed(await reap.handle(due_event(wf)), Outcome.RESCHEDULED)
    assert "argo-archiving" in (outcome.detail or "")
    assert await exists(kube, wf)
    # The wait is a durable schedule in NATS, not a held message: it fires by itself.
    again = await bus.next_due(due)
    assert (
        parse_payload(again, CleanupDue).deadline
        == parse_payload(due_event(wf), CleanupDue).deadline
    )  # still the original deadline: the wait stays bounded
    completed(await reap.handle(again), Outcome.RESCHEDULED)
    assert await exists(kube, wf)

    await edit(kube, wf, lambda o: o["metadata"]["labels"].update({ARCHIVING: "Archived"}))
    completed(await reap.handle(await bus.next_due(due)), Outcome.DELETED)
    assert not await exists(kube, wf)


async def test_kfp_run_waits_for_persisted_final_state(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-kfp")
    run_id = str(uuid.uuid4())
    wf = await finished_workflow(kube, ns, "kfp-run", kfp_run_id=run_id)
    reap = reaper(kube, bus, gate_retry={"backoff": "1s", "max_wait": "1h"})
    due = await bus.due_reader(wf["metadata"]["uid"])

    outcome = completed(await reap.handle(due_event(wf)), Outcome.RESCHEDULED)
    assert "pipeline/persistedFinalState" in (outcome.detail or "")
    assert await exists(kube, wf)
    completed(await reap.handle(await bus.next_due(due)), Outcome.RESCHEDULED)
    assert await exists(kube, wf)

    await edit(
        kube, wf, lambda o: o["metadata"]["labels"].update({"pipeline/persistedFinalState": "true"})
    )
    completed(await reap.handle(await bus.next_due(due)), Outcome.DELETED)
    assert not await exists(kube, wf)


async def test_gate_that_never_opens_is_reported_not_waited_on_forever(
    kube: KubeStack, bus: Bus
) -> None:
    ns = kube.namespace("reaper-stuck")
    wf = await finished_workflow(
        kube, ns, "stuck", archiving="Pending", finished_ago=timedelta(hours=2)
    )
    reap = reaper(kube, bus, gate_retry={"backoff": "10s", "max_wait": "30m"})
    outcome = failed(await reap.handle(due_event(wf)))
    assert "argo-archiving" in outcome.reason and "max_wait" in outcome.reason
    assert await exists(kube, wf)
    assert await bus.schedules.get(Target.KUBERNETES, wf["metadata"]["uid"]) is None


async def test_namespace_outside_the_scope_is_not_even_read(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-excluded")
    wf = await finished_workflow(kube, ns, "out-of-scope")
    calls = Calls(kube.workflows)
    scoped = reaper(kube, bus, workflows=calls, namespaces={"exclude": ["reaper-excl*"]})
    outcome = completed(await scoped.handle(due_event(wf)), Outcome.SKIPPED)
    assert "reaper-excl*" in (outcome.detail or "")
    assert (calls.gets, calls.deletes) == (0, 0)
    assert await exists(kube, wf)


async def test_dry_run_deletes_nothing(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-dry-run")
    wf = await finished_workflow(kube, ns, "rehearsal")
    calls = Calls(kube.workflows)
    reap = reaper(kube, bus, workflows=calls, dry_run=True)
    outcome = completed(await reap.handle(due_event(wf)), Outcome.DRY_RUN)
    assert outcome.dry_run is True
    assert calls.deletes == 0
    assert await exists(kube, wf)
    completed(await reap.handle(due_event(wf)), Outcome.DRY_RUN)  # and again: same answer


# --- step 5: rate limit and brake -------------------------------------------------------


async def test_deletions_are_paced_not_dropped(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-paced")
    wfs = [await finished_workflow(kube, ns, f"paced-{i}") for i in range(4)]
    reap = reaper(kube, bus, max_deletions_per_second=2)
    start = time.monotonic()
    results = await asyncio.gather(*(reap.handle(due_event(wf)) for wf in wfs))
    elapsed = time.monotonic() - start
    for events in results:
        completed(events, Outcome.DELETED)
    # Two at once (the burst), then one every 0.5 s.
    assert elapsed >= 0.95
    assert not any([await exists(kube, wf) for wf in wfs])


async def test_mass_deletion_brake_pauses_and_alerts_once(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-brake")
    wfs = [await finished_workflow(kube, ns, f"mass-{i}") for i in range(4)]
    reap = reaper(kube, bus, mass_deletion_brake={"max_due": 2, "window": "1m"})
    completed(await reap.handle(due_event(wfs[0])), Outcome.DELETED)
    completed(await reap.handle(due_event(wfs[1])), Outcome.DELETED)

    tripped = await reap.handle(due_event(wfs[2]))
    alert, held = (parse_payload(e) for e in tripped)
    assert isinstance(alert, CleanupFailed) and alert.stage == "brake"
    assert "mass-deletion brake" in alert.reason
    assert isinstance(held, CleanupCompleted) and held.outcome is Outcome.RESCHEDULED
    # While paused: no second alert, the object is held back by a durable schedule.
    completed(await reap.handle(due_event(wfs[3])), Outcome.RESCHEDULED)
    for wf in wfs[2:]:
        assert await exists(kube, wf)
        pending = await bus.schedules.get(Target.KUBERNETES, wf["metadata"]["uid"])
        assert pending is not None
        assert timedelta(seconds=50) < pending.deadline - datetime.now(UTC) <= timedelta(minutes=1)
    assert len(await bus.stored(STREAMS.dlq, "lapse.dlq.>")) == 1


@pytest.mark.parametrize(
    ("read_before_delete", "trust", "provenance"),
    [
        # A claim is read first: the held version is one the reaper's GET returned.
        ("auto", Trust.CLAIM, Provenance.READ_BY_LAPSE),
        # Judged as planned, and the due event was lapse's own read.
        ("auto", Trust.OBSERVED, Provenance.READ_BY_LAPSE),
        # Judged as planned only because reading is off: whatever the delivery, a claim.
        (False, Trust.OBSERVED, Provenance.CLAIMED),
    ],
)
async def test_a_held_deletion_is_rescheduled_with_what_lapse_knows_of_its_version(
    kube: KubeStack,
    bus: Bus,
    read_before_delete: bool | str,
    trust: Trust,
    provenance: Provenance,
) -> None:
    """The brake's re-schedule says "lapse read this" (Lapse-Observed) only of a version
    lapse read: a fresh GET, or a planned Delete whose due event was `OBSERVED` under
    read_before_delete auto; never of a planned Delete that nothing read."""
    ns = kube.namespace(f"reaper-held-{str(read_before_delete).lower()}-{trust.value}")
    first, held = [await finished_workflow(kube, ns, f"held-{i}") for i in range(2)]
    reap = reaper(
        kube,
        bus,
        read_before_delete=read_before_delete,
        mass_deletion_brake={"max_due": 1, "window": "1m"},
    )
    completed(await reap.handle(due_event(first), trust), Outcome.DELETED)
    tripped = [parse_payload(e) for e in await reap.handle(due_event(held), trust)]
    assert any(
        isinstance(e, CleanupCompleted) and e.outcome is Outcome.RESCHEDULED for e in tripped
    )
    uid = held["metadata"]["uid"]
    msg = await bus.js.get_last_msg(STREAMS.schedule, schedule_subject(Target.KUBERNETES, uid))
    marked = (msg.headers or {}).get(OBSERVED_HEADER) == API_SERVER
    assert marked is (provenance is Provenance.READ_BY_LAPSE)
    assert await exists(kube, held)


# --- step 6: what the DELETE can answer -------------------------------------------------


async def test_change_between_get_and_delete_is_read_again(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-conflict")
    wf = await finished_workflow(kube, ns, "busy")
    label = {"example.com/touched": "yes"}
    meddling = Meddling(kube.workflows, meddle=lambda o: o["metadata"]["labels"].update(label))
    completed(await reaper(kube, bus, workflows=meddling).handle(due_event(wf)), Outcome.DELETED)
    # The first DELETE carried the stale resourceVersion and got a 409.
    assert (meddling.gets, meddling.deletes) == (2, 2)
    assert not await exists(kube, wf)


async def test_keep_added_between_get_and_delete_wins(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-conflict-keep")
    wf = await finished_workflow(kube, ns, "rescued")
    meddling = Meddling(
        kube.workflows,
        meddle=lambda o: o["metadata"]["annotations"].update({"lapse.dev/keep": "true"}),
    )
    completed(await reaper(kube, bus, workflows=meddling).handle(due_event(wf)), Outcome.KEPT)
    assert meddling.deletes == 1  # refused by the precondition
    assert await exists(kube, wf)


async def test_server_error_retries_later(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-503")
    wf = await finished_workflow(kube, ns, "unlucky")
    flaky = FlakyDelete(kube.workflows)
    reap = reaper(kube, bus, workflows=flaky)
    with pytest.raises(RetryLater) as retry:
        await reap.handle(due_event(wf))
    assert "HTTP 503" in retry.value.reason and retry.value.delay > 0
    assert await exists(kube, wf)
    completed(await reap.handle(due_event(wf)), Outcome.DELETED)  # the redelivery


async def test_unreachable_api_server_retries_later(kube: KubeStack, bus: Bus) -> None:
    ns = kube.namespace("reaper-unreachable")
    wf = await finished_workflow(kube, ns, "islanded")
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    configuration.verify_ssl = False
    configuration.retries = 0
    nowhere = client.ApiClient(configuration)
    try:
        reap = reaper(kube, bus, workflows=ReapedObjects(KubeObjects(nowhere, kube.executor)))
        with pytest.raises(RetryLater) as retry:
            await reap.handle(due_event(wf))
    finally:
        nowhere.close()
    assert "no response" in retry.value.reason
    assert await exists(kube, wf)


@pytest.fixture
def readonly_workflows(kube: KubeStack, tmp_path: Path) -> Iterator[KubeObjects]:
    """Workflows as `lapse-readonly`, bound to get/list/watch on workflows and nothing else."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    name = f"lapse-reaper-test-readonly-{uuid.uuid4().hex[:6]}"
    rbac.create_cluster_role(
        client.V1ClusterRole(
            metadata=client.V1ObjectMeta(name=name),
            rules=[
                client.V1PolicyRule(
                    api_groups=["argoproj.io"],
                    resources=["workflows"],
                    verbs=["get", "list", "watch"],
                )
            ],
        )
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
            ),
            subjects=[
                client.RbacV1Subject(
                    kind="User", name=READONLY_USER, api_group="rbac.authorization.k8s.io"
                )
            ],
        )
    )
    path = tmp_path / "readonly.kubeconfig"
    path.write_text(
        yaml.safe_dump(kube.server.kubeconfig(kube.server.readonly_token, user=READONLY_USER))
    )
    api_client = load_api_client(str(path))
    yield KubeObjects(api_client, kube.executor)
    api_client.close()
    # The readonly user is shared by the session: take the rights away again.
    rbac.delete_cluster_role_binding(name)
    rbac.delete_cluster_role(name)


async def test_missing_delete_permission_fails_loudly(
    kube: KubeStack, bus: Bus, readonly_workflows: KubeObjects
) -> None:
    ns = kube.namespace("reaper-rbac")
    wf = await finished_workflow(kube, ns, "guarded")

    async def can_read() -> bool:
        try:
            return await readonly_workflows.get(ARGO_WORKFLOW, ns, "guarded") is not None
        except ApiException as exc:
            if exc.status == 403:  # the RBAC authorizer's cache has not seen the binding yet
                return False
            raise

    await wait_for(can_read, timeout=30, interval=0.2)
    readonly = ReapedObjects(readonly_workflows)
    outcome = failed(await reaper(kube, bus, workflows=readonly).handle(due_event(wf)))
    assert outcome.reason.startswith("forbidden: ")
    assert f'User "{READONLY_USER}" cannot delete resource "workflows"' in outcome.reason
    assert "'delete' verb on workflows.argoproj.io in namespace 'reaper-rbac'" in outcome.reason
    assert outcome.run is not None and outcome.run.uid == wf["metadata"]["uid"]
    assert await exists(kube, wf)
    dead = await bus.stored(STREAMS.dlq, "lapse.dlq.>")
    assert [parse_payload(e, CleanupFailed).reason for e in dead] == [outcome.reason]


# --- input the reaper does not own --------------------------------------------------------


async def test_database_deadline_is_ignored_and_garbage_dead_lettered(
    kube: KubeStack, bus: Bus
) -> None:
    ns = kube.namespace("reaper-input")
    wf = await finished_workflow(kube, ns, "rows-only")
    reap = reaper(kube, bus)
    due = parse_payload(due_event(wf), CleanupDue)
    database = due.model_copy(update={"target": Target.DATABASE})
    assert await reap.handle(build_event(EventType.CLEANUP_DUE, source="/t", data=database)) == []
    assert await exists(kube, wf)

    finished = build_event(EventType.RUN_FINISHED, source="/t", data=RunFinished(run=due.run))
    outcome = failed(await reap.handle(finished))
    assert "CleanupDue" in outcome.reason and outcome.original is not None
    assert await exists(kube, wf)
