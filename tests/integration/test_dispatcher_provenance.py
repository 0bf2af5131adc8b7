"""What the dispatcher believes comes from where a message came from, not from its header
(issue 36): a due event with `Lapse-Observed` that a push consumer of another stream
delivered into the dispatcher's pull inbox is a claim; lapse's own due event, delivered
by the route's own durable the first time, is still observed.

The attacker's steps are played on a NATS without permissions (on lapse's, every step is
refused: tests/integration/test_identity_matrix.py), so that what is checked here is the
dispatcher's own decision: learn the pull inbox from the fetch requests, point a push
consumer of a stream one may write (the audit stream) at it, publish a forged due event.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lapse.config import NatsConfig, Streams
from lapse.edges.publishing import NatsEmitter
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.observed import observed_mark
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.functions.trust import Trust
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.routing import Route
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()


class Recorder:
    def __init__(self) -> None:
        self.seen: dict[str, Trust] = {}

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        self.seen[event.get_id()] = trust
        return []


def due_event(uid: str) -> BaseCloudEvent:
    past = datetime.now(UTC) - timedelta(hours=1)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"wf-{uid[:6]}", uid=uid, phase="Succeeded",
        finished_at=past, resource_version="1",
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=past, policy="annotation",
        scheduled_at=past,
    )  # fmt: skip
    return build_event(EventType.CLEANUP_DUE, source="/test", data=due)


async def test_a_due_event_from_a_consumer_not_lapses_is_a_claim_despite_its_header(
    lapse_streams: JetStreamContext,
) -> None:
    nc = lapse_streams._nc
    route = Route(
        name=f"provenance-{uuid.uuid4().hex[:6]}",
        function="object-reaper",
        filters={"type": EventType.CLEANUP_DUE, "target": "kubernetes"},
    )
    # The attacker listens for the dispatcher's fetches: their reply is its pull inbox.
    inboxes: asyncio.Queue[str] = asyncio.Queue()

    async def fetch_seen(msg: Msg) -> None:
        if msg.reply:
            inboxes.put_nowait(msg.reply)

    spy = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.*.lapse-{route.name}", cb=fetch_seen)
    handler = Recorder()
    dispatcher = Dispatcher(
        lapse_streams, NatsEmitter(lapse_streams, STREAMS), NatsConfig(),
        [Subscription(route, handler)],
    )  # fmt: skip
    running = asyncio.create_task(dispatcher.run())
    forger = f"forger-{uuid.uuid4().hex[:6]}"
    try:
        inbox = await asyncio.wait_for(inboxes.get(), 30)
        # lapse's own: a due event on the schedule stream, marked, first delivery.
        own = due_event(str(uuid.uuid4()))
        message = to_nats(own)
        await lapse_streams.publish(
            due_subject(Target.KUBERNETES, str(uuid.uuid4())),
            message.body,
            headers={**message.headers, **observed_mark()},
        )
        # The forgery: the same mark, pushed into the dispatcher's inbox by another stream's
        # consumer while the dispatcher waits on a fetch.
        forged = due_event(str(uuid.uuid4()))
        audit_subject = f"lapse.audit.forged.{uuid.uuid4().hex[:6]}"
        await lapse_streams.add_consumer(
            STREAMS.audit,
            ConsumerConfig(
                name=forger, filter_subject=audit_subject, deliver_subject=inbox,
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.NEW,
            ),
        )  # fmt: skip
        forged_message = to_nats(forged)
        await lapse_streams.publish(
            audit_subject,
            forged_message.body,
            headers={**forged_message.headers, **observed_mark()},
        )

        async def both() -> bool:
            return {own.get_id(), forged.get_id()} <= handler.seen.keys()

        await wait_for(both, timeout=30, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
        await spy.unsubscribe()
        await lapse_streams.delete_consumer(STREAMS.audit, forger)
    assert handler.seen[own.get_id()] is Trust.OBSERVED
    assert handler.seen[forged.get_id()] is Trust.CLAIM
