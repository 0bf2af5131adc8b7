"""Waiting out a transient failure, made visible.

A handler that raises `RetryLater` (the API server or the database unreachable, a 429 or a
5xx) is never dead-lettered for it: the dispatcher delivers the event again after a capped,
jittered back-off, for as long as the outage lasts (docs/architecture.md, "How a deletion
is made safe"). This module keeps what an operator needs to see meanwhile: per function,
since when it has been waiting, why, and how many events wait. The `lapse.waiting` and
`lapse.outage.duration` gauges report it; the log says when an outage begins and ends.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from cloudevents.core.base import BaseCloudEvent
from nats import errors as nats_errors
from nats.js import errors as js_errors

from lapse import telemetry
from lapse.functions.ports import Emitter

log = logging.getLogger(__name__)

# What nats-py raises while the NATS server, or the leader of a stream in a cluster, cannot
# answer: a server restarting, a RAFT election after a node was lost, a reconnect. A handler
# that meets one (emitting its outcome, publishing a schedule) has met an outage, not a bug.
NATS_UNAVAILABLE: tuple[type[Exception], ...] = (
    nats_errors.TimeoutError,
    nats_errors.NoRespondersError,
    js_errors.NoStreamResponseError,
    js_errors.ServiceUnavailableError,
    nats_errors.ConnectionClosedError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.StaleConnectionError,
    nats_errors.OutboundBufferLimitError,
)


# JetStream's error code for a stream that does not exist.
STREAM_NOT_FOUND = 10059


def nats_unavailable(exc: BaseException) -> str | None:
    """Why `exc` means NATS is unavailable for now (a reason to wait it out), or None."""
    if isinstance(exc, NATS_UNAVAILABLE):
        text = " ".join(str(exc).split()).removeprefix("nats: ")
        return f"NATS unavailable ({type(exc).__name__}: {text})"
    return None


@dataclass(frozen=True)
class Backoff:
    """Seconds before the next try of an event that failed transiently: exponential from
    `first`, capped at `cap` (one probe per event per minute while an outage lasts), never
    sooner than the server's Retry-After (which may exceed the cap), with ±`jitter` so a
    thousand waiting events do not retry in the same instant."""

    first: float = 1.0
    cap: float = 60.0
    jitter: float = 0.2

    def delay(
        self, attempt: int, hint: float | None = None, rng: random.Random | None = None
    ) -> float:
        exponential = min(self.cap, self.first * 2.0 ** max(0, attempt - 1))
        base = max(exponential, hint or 0.0)
        spread = (rng or random).uniform(1 - self.jitter, 1 + self.jitter)
        # The jitter spreads retries out, but never to before the server's Retry-After.
        return float(max(0.01, hint or 0.0, base * spread))


@dataclass
class _Outage:
    since: float
    reason: str
    waiting: set[int] = field(default_factory=set)


class Outages:
    """Per function: the events waiting out a transient failure (by stream sequence)."""

    def __init__(self) -> None:
        self._outages: dict[str, _Outage] = {}

    def waiting(self, function: str, key: int, reason: str, now: float) -> None:
        outage = self._outages.get(function)
        if outage is None:
            outage = self._outages[function] = _Outage(now, reason)
            log.warning("%s: waiting out a transient failure: %s", function, reason)
        outage.reason = reason
        outage.waiting.add(key)
        self._report(function, now)

    def done(self, function: str, key: int, now: float) -> None:
        """The event `key` was handled (or given up): it waits no more."""
        outage = self._outages.get(function)
        if outage is None:
            return
        outage.waiting.discard(key)
        if not outage.waiting:
            del self._outages[function]
            log.warning("%s: recovered after %.0fs", function, now - outage.since)
        self._report(function, now)

    def describe(self, now: float) -> dict[str, tuple[float, int, str]]:
        """function -> (seconds waiting, events waiting, last reason)."""
        return {
            name: (now - o.since, len(o.waiting), o.reason) for name, o in self._outages.items()
        }

    def _report(self, function: str, now: float) -> None:
        outage = self._outages.get(function)
        if outage is None:
            telemetry.observe_waiting(function, 0, 0.0)
        else:
            telemetry.observe_waiting(function, len(outage.waiting), now - outage.since)


# How long an emit waits out NATS in place (a stream leader being elected takes seconds),
# well inside the 30 s a stopping pod is given to finish its work in flight.
EMIT_PATIENCE = 10.0
EMIT_BACKOFF = Backoff(first=0.25, cap=2.0)


class PatientEmitter:
    """Emits through `inner`, waiting out NATS's unavailability in place for up to
    `patience` seconds before the failure reaches the handler.

    A handler emits its outcome after it acted (an object deleted, rows removed). Were the
    emit's failure to send the event round again, the next try would judge afresh, find
    nothing left and record `already_gone` for what this process deleted. Waiting here
    keeps the true outcome through a RAFT election; a longer outage still fails the emit
    and the event is waited out by redelivery as before. Emitting again is safe: every
    event's id is its `Nats-Msg-Id`, so a copy NATS stored without confirming is dropped
    as a duplicate."""

    def __init__(
        self,
        inner: Emitter,
        *,
        patience: float = EMIT_PATIENCE,
        backoff: Backoff = EMIT_BACKOFF,
    ) -> None:
        self._inner = inner
        self._patience = patience
        self._backoff = backoff

    async def emit(self, event: BaseCloudEvent) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._patience
        attempt = 0
        while True:
            try:
                await self._inner.emit(event)
                return
            except Exception as exc:
                reason = nats_unavailable(exc)
                attempt += 1
                delay = self._backoff.delay(attempt)
                if reason is None or loop.time() + delay > deadline:
                    raise
                log.info("emit of %s: %s; again in %.2fs", event.get_id(), reason, delay)
                await asyncio.sleep(delay)
