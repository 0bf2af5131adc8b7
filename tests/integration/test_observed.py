"""Trust on a real NATS server (functions/trust.py, lapse/runtime/trust.py): only what lapse
itself read from the API server reaches a handler as `Trust.OBSERVED`, however an event
claims it.

The chain: the watcher's publisher writes `Lapse-Observed`; the planner keeps the mark on
the schedule it puts for a version it may trust; the server copies the schedule's headers
onto the due message; the dispatcher decides the trust from that header alone, on a first
delivery. An event that claims it in its content (a `ce-lapseobserved` attribute, as anyone
posting to an ingress can write) is a claim. Who may write the header at all is NATS's
permissions' business (tests/integration/test_nats_security.py).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent
from nats.js import JetStreamContext

from lapse.config import NatsConfig, Streams
from lapse.edges.publishing import NatsEmitter, NatsPublisher
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue, RunFinished
from lapse.events.nats_binding import to_nats
from lapse.events.observed import OBSERVED_HEADER
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject, event_subject, schedule_subject
from lapse.events.types import EventType
from lapse.functions.ports import RetryLater
from lapse.functions.trust import Provenance, Trust
from lapse.functions.ttl_planner import Planner
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.routing import Route
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()
ROUTE = Route(
    name="observed-due",
    function="object-reaper",
    filters={"type": EventType.CLEANUP_DUE, "target": "kubernetes"},
)


def run_ref(uid: str, finished: datetime) -> RunRef:
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"wf-{uid[:6]}", uid=uid, phase="Succeeded",
        finished_at=finished, annotations={"lapse.dev/ttl": "2s"},
    )  # fmt: skip


def due_event(uid: str, deadline: datetime) -> BaseCloudEvent:
    due = CleanupDue(
        run=run_ref(uid, deadline - timedelta(seconds=2)), target=Target.KUBERNETES,
        deadline=deadline, policy="annotation", scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    return build_event(EventType.CLEANUP_DUE, source="/test", data=due)


def claiming_the_mark(event: BaseCloudEvent) -> BaseCloudEvent:
    """The event with the attribute a forger would add."""
    attributes = {**event.get_attributes(), "lapseobserved": "apiserver"}
    return CloudEvent(attributes=attributes, data=event.get_data())


class Recorder:
    def __init__(self) -> None:
        self.observed: dict[str, bool] = {}

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        data = event.get_data()
        assert isinstance(data, dict)
        self.observed[data["run"]["uid"]] = trust.observed
        return []


class GoneObjects:
    """The planner's read of a claimed object: the API server has none (the claim is then
    refused)."""

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        return None


async def last_headers(js: JetStreamContext, stream: str, subject: str) -> dict[str, str]:
    msg = await js.get_last_msg(stream, subject)
    return dict(msg.headers or {})


async def test_only_lapses_own_header_marks_a_delivered_due_event(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    store = NatsScheduleStore(js, STREAMS)
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
    read, claimed, forged = (str(uuid.uuid4()) for _ in range(3))
    # A schedule the planner put for a version lapse read, and one for a claim.
    await store.put(
        Target.KUBERNETES,
        read,
        deadline,
        due_event(read, deadline),
        provenance=Provenance.READ_BY_LAPSE,
    )
    await store.put(
        Target.KUBERNETES,
        claimed,
        deadline,
        due_event(claimed, deadline),
        provenance=Provenance.CLAIMED,
    )
    # A due message written with the attribute but without lapse's header.
    message = to_nats(claiming_the_mark(due_event(forged, deadline)))
    assert "ce-lapseobserved" in message.headers
    await js.publish(due_subject(Target.KUBERNETES, forged), message.body, headers=message.headers)

    recorder = Recorder()
    dispatcher = Dispatcher(
        js, NatsEmitter(js, STREAMS), NatsConfig(), [Subscription(ROUTE, recorder)]
    )
    running = asyncio.create_task(dispatcher.run())
    try:

        async def all_delivered() -> bool:
            return len(recorder.observed) == 3

        await wait_for(all_delivered, timeout=30, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
    assert recorder.observed == {read: True, claimed: False, forged: False}


async def test_the_planner_keeps_the_mark_on_the_schedule_and_the_watchers_publisher_sets_it(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    planner = Planner(
        NatsScheduleStore(js, STREAMS), NatsEmitter(js, STREAMS), fetcher=GoneObjects()
    )
    finished = datetime.now(UTC) - timedelta(seconds=1)
    seen, told = str(uuid.uuid4()), str(uuid.uuid4())
    for uid, observed in ((seen, True), (told, False)):
        pending = run_ref(uid, finished).model_copy(update={"annotations": {"lapse.dev/ttl": "1h"}})
        event = build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=pending))
        await planner.handle(event, Trust.OBSERVED if observed else Trust.CLAIM)
    seen_at = schedule_subject(Target.KUBERNETES, seen)
    assert (await last_headers(js, STREAMS.schedule, seen_at)).get(OBSERVED_HEADER) == "apiserver"
    # A claim lapse cannot read is not planned at all, marked or not.
    assert await NatsScheduleStore(js, STREAMS).get(Target.KUBERNETES, told) is None

    # The watcher's publisher says so; the ingress's does not, whatever the event claims.
    subject = event_subject(EventType.RUN_FINISHED)
    for provenance in Provenance:
        event = build_event(
            EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run_ref(seen, finished))
        )
        await NatsPublisher(js, STREAMS, provenance=provenance).publish(claiming_the_mark(event))
        headers = await last_headers(js, STREAMS.events, subject)
        marked = headers.get(OBSERVED_HEADER) == "apiserver"
        assert marked is (provenance is Provenance.READ_BY_LAPSE)


class FailsOnce:
    """Raises RetryLater on the first delivery: the event comes back as a redelivery."""

    def __init__(self) -> None:
        self.observed: list[bool] = []

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        self.observed.append(trust.observed)
        if len(self.observed) == 1:
            raise RetryLater("not yet", 0.2)
        return []


async def test_a_redelivered_due_event_is_not_marked(lapse_streams: JetStreamContext) -> None:
    """The first delivery may have deleted already (killed before its ack): the second one
    must read first, not DELETE the planned version again."""
    js = lapse_streams
    uid = str(uuid.uuid4())
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    await NatsScheduleStore(js, STREAMS).put(
        Target.KUBERNETES,
        uid,
        deadline,
        due_event(uid, deadline),
        provenance=Provenance.READ_BY_LAPSE,
    )
    handler = FailsOnce()
    route = Route(
        name="observed-redelivery",
        function="object-reaper",
        filters={"type": EventType.CLEANUP_DUE, "target": "kubernetes"},
    )
    dispatcher = Dispatcher(
        js, NatsEmitter(js, STREAMS), NatsConfig(), [Subscription(route, handler)]
    )
    running = asyncio.create_task(dispatcher.run())
    try:

        async def delivered_twice() -> bool:
            return len(handler.observed) >= 2

        await wait_for(delivered_twice, timeout=30, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
    assert handler.observed[:2] == [True, False]
