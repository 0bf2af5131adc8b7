"""Held work stays held: a handler that takes several ack waits is not delivered again
meanwhile (the dispatcher marks what it holds in progress), so a short `nats.ack_wait`
only decides how soon a dead process's work comes back."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext

from lapse.config import NatsConfig, Streams
from lapse.edges import streams
from lapse.edges.nats import connect
from lapse.edges.publishing import NatsEmitter
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.functions.trust import Trust
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.outages import Backoff
from lapse.runtime.routing import Route
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()
ROUTE = Route(
    name="heartbeat-due",
    function="object-reaper",
    filters={"type": EventType.CLEANUP_DUE, "target": "kubernetes"},
)


class Slow:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0
        self.done = 0

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        self.calls += 1
        await asyncio.sleep(self.seconds)
        self.done += 1
        return []


async def test_work_longer_than_the_ack_wait_is_not_delivered_twice(
    lapse_streams: JetStreamContext,
) -> None:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name="slow", uid=str(uuid.uuid4()), phase="Succeeded",
        finished_at=datetime.now(UTC) - timedelta(hours=1),
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=datetime.now(UTC), policy="p",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    message = to_nats(build_event(EventType.CLEANUP_DUE, source="/test", data=due))
    handler = Slow(seconds=4.0)
    config = NatsConfig(ack_wait=timedelta(seconds=1))
    dispatcher = Dispatcher(
        lapse_streams, NatsEmitter(lapse_streams, STREAMS), config, [Subscription(ROUTE, handler)]
    )
    running = asyncio.create_task(dispatcher.run())
    try:
        subject = due_subject(Target.KUBERNETES, run.uid)
        await lapse_streams.publish(subject, message.body, headers=message.headers)

        async def handled() -> bool:
            return handler.done == 1

        await wait_for(handled, timeout=30, interval=0.1)
        await asyncio.sleep(2.5)  # more than two ack waits after the work ended

        async def acked() -> Any:
            info = await lapse_streams.consumer_info(STREAMS.schedule, "lapse-heartbeat-due")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_for(acked, timeout=10, interval=0.2)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
    assert handler.calls == 1, "four ack waits of work, one delivery"


async def test_subscribing_waits_out_nats_being_unavailable(own_nats: EmbeddedNats) -> None:
    """A durable consumer that cannot be created yet (NATS restarting, a stream leader being
    elected, a JetStream API answer later than its timeout on a loaded cluster) is waited
    for: the dispatcher once ended at start-up on such a timeout (a 3-node CI run)."""
    nc = await connect(own_nats.url)
    js = nc.jetstream(timeout=1.0)
    await streams.ensure_streams(js, streams.stream_configs(STREAMS))
    handler = Slow(seconds=0.0)
    dispatcher = Dispatcher(
        js,
        NatsEmitter(js, STREAMS),
        NatsConfig(),
        [Subscription(ROUTE, handler)],
        backoff=Backoff(first=0.2, cap=1.0),
    )
    own_nats.stop()
    running = asyncio.create_task(dispatcher.run())
    try:
        await asyncio.sleep(3)  # it tries to subscribe, and fails, a few times
        assert not running.done(), running.exception() if running.done() else None
        own_nats.start(healthy=True)
        message = to_nats(build_event(EventType.CLEANUP_DUE, source="/test", data=_due()))
        await js.publish(due_subject(Target.KUBERNETES, "after-restart"), message.body,
                         headers=message.headers)  # fmt: skip

        async def handled() -> bool:
            return handler.done == 1

        await wait_for(handled, timeout=60, interval=0.2)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
        await nc.close()


def _due() -> CleanupDue:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name="after-restart", uid="after-restart", phase="Succeeded",
        finished_at=datetime.now(UTC) - timedelta(hours=1),
    )  # fmt: skip
    return CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=datetime.now(UTC), policy="p",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
