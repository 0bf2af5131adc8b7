"""`emit_all`: a handler's events pipelined, in order, and all of them awaited."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import build_event
from lapse.events.models import CleanupFailed
from lapse.events.types import EventType
from lapse.functions.ports import emit_all


def _events(n: int) -> list[BaseCloudEvent]:
    return [
        build_event(
            EventType.CLEANUP_FAILED,
            source="/test",
            data=CleanupFailed(reason=f"event {i}", stage="test"),
            id=f"e{i}",
            time=datetime(2026, 1, 1, tzinfo=UTC),
        )
        for i in range(n)
    ]


class SlowEmitter:
    """Queues each event at once (as a NATS publish does), then waits for its 'ack':
    answers come back in reverse order, and one may fail."""

    def __init__(self, fail: str | None = None) -> None:
        self.queued: list[str] = []
        self.acked: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._fail = fail

    async def emit(self, event: BaseCloudEvent) -> None:
        event_id = str(event.get_id())
        self.queued.append(event_id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01 * (10 - len(self.queued)))
        self.in_flight -= 1
        if event_id == self._fail:
            raise ConnectionError(f"no ack for {event_id}")
        self.acked.append(event_id)


async def test_events_are_sent_in_order_and_their_acks_awaited_together() -> None:
    emitter = SlowEmitter()
    events = _events(4)
    assert await emit_all(emitter, events) is events
    assert emitter.queued == ["e0", "e1", "e2", "e3"]  # the order they are stored in
    assert emitter.most_in_flight == 4  # one round trip's wait for all four
    assert sorted(emitter.acked) == ["e0", "e1", "e2", "e3"]


async def test_a_failure_is_raised_only_once_every_emit_has_ended() -> None:
    emitter = SlowEmitter(fail="e1")
    with pytest.raises(ConnectionError, match="e1"):
        await emit_all(emitter, _events(3))
    # Nothing is left running behind a handler whose input will be delivered again.
    assert emitter.in_flight == 0
    assert sorted(emitter.acked) == ["e0", "e2"]


async def test_one_event_or_none() -> None:
    emitter = SlowEmitter()
    assert await emit_all(emitter, []) == []
    (event,) = _events(1)
    assert await emit_all(emitter, [event]) == [event]
    assert emitter.acked == ["e0"]
