"""An outcome emitted while NATS cannot answer is kept, not re-judged: the emitter handlers
are given waits out a short unavailability in place (a stream leader's election), so the
event reaches the audit stream once, as the handler made it.

Before, the emit's failure failed the handling; the redelivered event was judged afresh,
found its object gone, and a deletion lapse made was recorded as `already_gone` (CI: 85 of
1,000 outcomes while a 3-node cluster elected a new leader, tests/e2e/test_nats_cluster.py).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from cloudevents.core.base import BaseCloudEvent

from lapse.config import Streams
from lapse.edges import streams
from lapse.edges.nats import connect
from lapse.edges.publishing import NatsEmitter
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import CleanupFailed
from lapse.events.subjects import audit_subject
from lapse.events.types import EventType
from lapse.runtime.outages import Backoff, PatientEmitter
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()


class Counting:
    """Passes every emit on to the real emitter, counting the tries and their failures."""

    def __init__(self, inner: NatsEmitter) -> None:
        self.inner = inner
        self.tries = 0
        self.failed = 0

    async def emit(self, event: BaseCloudEvent) -> None:
        self.tries += 1
        try:
            await self.inner.emit(event)
        except Exception:
            self.failed += 1
            raise


def _outcome() -> BaseCloudEvent:
    return build_event(
        EventType.CLEANUP_FAILED,
        source="/test",
        data=CleanupFailed(reason="an outcome", stage="test"),
        id=str(uuid.uuid4()),
        time=datetime.now(UTC),
    )


async def test_an_emit_waits_out_a_nats_restart_and_is_stored_once(own_nats: EmbeddedNats) -> None:
    nc = await connect(own_nats.url)
    js = nc.jetstream(timeout=1.0)
    await streams.ensure_streams(js, streams.stream_configs(STREAMS))
    counting = Counting(NatsEmitter(js, STREAMS))
    emitter = PatientEmitter(counting, patience=60.0, backoff=Backoff(first=0.2, cap=0.5))
    event = _outcome()
    try:
        own_nats.kill()
        emitting = asyncio.create_task(emitter.emit(event))

        async def failed_twice() -> bool:
            return counting.failed >= 2

        await wait_for(failed_twice, timeout=30, interval=0.1)
        assert not emitting.done(), "the emit gave up while NATS was down"
        own_nats.start(healthy=True)
        await asyncio.wait_for(emitting, 60)
        # Emitted again by hand: a copy stored without its ack confirmed is a duplicate.
        await emitter.emit(event)
        info = await js.stream_info(STREAMS.audit)
        subject = audit_subject(EventType.CLEANUP_FAILED)
        stored = await js.get_last_msg(STREAMS.audit, subject)
        assert stored.headers is not None and stored.headers["Nats-Msg-Id"] == event.get_id()
        assert info.state.messages == 1, info.state
    finally:
        await nc.close()


async def test_without_patience_the_same_emit_fails(own_nats: EmbeddedNats) -> None:
    """What handlers met before: the first failure is the handler's failure."""
    nc = await connect(own_nats.url)
    js = nc.jetstream(timeout=1.0)
    await streams.ensure_streams(js, streams.stream_configs(STREAMS))
    counting = Counting(NatsEmitter(js, STREAMS))
    emitter = PatientEmitter(counting, patience=0.0)
    try:
        own_nats.kill()
        with pytest.raises(Exception) as failure:
            await emitter.emit(_outcome())
        assert counting.tries == 1
        assert type(failure.value).__module__.startswith("nats"), failure.value
    finally:
        own_nats.start(healthy=True)
        await nc.close()


async def test_a_failure_that_is_not_an_outage_is_not_waited_for() -> None:
    class Broken:
        tries = 0

        async def emit(self, event: BaseCloudEvent) -> None:
            self.tries += 1
            raise ValueError("a bug, not an outage")

    broken = Broken()
    with pytest.raises(ValueError):
        await PatientEmitter(broken, patience=60.0).emit(_outcome())
    assert broken.tries == 1
