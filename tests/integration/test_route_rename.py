"""A renamed route keeps its place in the stream: the Trigger `object-reaper-due` was
`workflow-reaper-due`, and its durable consumer starts where the old one had acknowledged
up to (annotation `lapse.dev/formerly`), so a renamed reaper neither repeats the due
events of the last `due_message_ttl` nor skips the ones not yet handled. Real NATS."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from lapse.config import NatsConfig, Streams
from lapse.edges.publishing import NatsEmitter
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.functions.trust import Trust
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.routing import Route, load_routes
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]
STREAMS = Streams()


class Recorder:
    def __init__(self) -> None:
        self.uids: list[str] = []

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        payload = parse_payload(event)
        assert isinstance(payload, CleanupDue)
        self.uids.append(payload.run.uid)
        return []


async def publish_due(js: JetStreamContext) -> str:
    uid = str(uuid.uuid4())
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"wf-{uid[:6]}", uid=uid, phase="Succeeded",
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=datetime.now(UTC), policy="p",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    message = to_nats(build_event(EventType.CLEANUP_DUE, source="/test", data=due))
    await js.publish(due_subject(Target.KUBERNETES, uid), message.body, headers=message.headers)
    return uid


def test_the_reaper_trigger_names_its_former_name() -> None:
    [route] = [r for r in load_routes() if r.function == "object-reaper"]
    assert (route.name, route.formerly) == ("object-reaper-due", "workflow-reaper-due")


async def test_a_renamed_route_starts_where_the_old_one_acknowledged(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    tag = uuid.uuid4().hex[:6]
    filters = {"type": EventType.CLEANUP_DUE, "target": "kubernetes"}
    old = Route(name=f"old-{tag}", function="object-reaper", filters=filters)
    new = Route(name=f"new-{tag}", function="object-reaper", filters=filters, formerly=old.name)

    handled = [await publish_due(js), await publish_due(js)]
    old_durable = f"lapse-{old.name}"
    sub = await js.pull_subscribe(
        old.subject,
        durable=old_durable,
        stream=STREAMS.schedule,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
    )
    seen: set[str] = set()
    while not set(handled) <= seen:  # the old reaper handles everything there is so far
        for msg in await sub.fetch(100, timeout=5):
            seen.add(msg.subject.rsplit(".", 1)[1])
            await msg.ack_sync()
    waiting = await publish_due(js)  # due after the old reaper stopped

    recorder = Recorder()
    dispatcher = Dispatcher(
        js, NatsEmitter(js, STREAMS), NatsConfig(), [Subscription(new, recorder)]
    )
    running = asyncio.create_task(dispatcher.run())
    try:

        async def delivered() -> bool:
            return waiting in recorder.uids

        await wait_for(delivered, timeout=30, interval=0.1)
        await asyncio.sleep(1)  # anything repeated would arrive meanwhile
        assert not set(handled) & set(recorder.uids)
        assert recorder.uids.count(waiting) == 1
        with pytest.raises(NotFoundError):
            await js.consumer_info(STREAMS.schedule, old_durable)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
