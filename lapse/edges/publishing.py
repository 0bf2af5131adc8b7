"""Publishing CloudEvents to NATS: the Emitter port (audit trail, dead letters) and the
ingress publisher.

Every publish is a PRODUCER span whose context goes in the message's `traceparent` header
(the hop); the event's own `traceparent` extension, set where it was created, travels
untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.errors import APIError

from lapse.config import Streams
from lapse.events.nats_binding import NatsMessage, to_nats
from lapse.events.observed import observed_mark, unclaimed
from lapse.events.subjects import audit_subject, dlq_subject, event_subject, relist_subject
from lapse.events.types import EventType
from lapse.functions.trust import Provenance
from lapse.telemetry import HopContext, send_span


class NatsEmitter:
    """Every produced event goes to the audit stream; failures also to the dead letters."""

    def __init__(self, js: JetStreamContext, streams: Streams) -> None:
        self._js = js
        self._streams = streams

    async def emit(self, event: BaseCloudEvent) -> None:
        event_type = event.get_type()
        await publish_event(self._js, audit_subject(event_type), self._streams.audit, event)
        if event_type == EventType.CLEANUP_FAILED:
            await publish_event(self._js, dlq_subject(event_type), self._streams.dlq, event)


class NatsPublisher:
    """Puts lifecycle events on `lapse.events.<type>`; returns once JetStream has stored
    them, so a caller that got an answer can forget the event.

    `provenance`: `READ_BY_LAPSE` for lapse's own watcher, whose events describe object
    versions it read from the API server; they carry lapse's header saying so
    (events/observed.py). `CLAIMED` for the ingress.
    `relist`: the watcher's re-list lane, `lapse.events.relist.<type>` (same stream, its
    own consumer), so that what a re-list repeats never delays a live finish.
    The ingress publishes what it was sent and never says so: whatever mark the sender
    put on the event (the `lapseobserved` extension) is dropped, not passed on."""

    def __init__(
        self,
        js: JetStreamContext,
        streams: Streams,
        *,
        provenance: Provenance,
        relist: bool = False,
    ) -> None:
        self._js = js
        self._stream = streams.events
        self._subject = relist_subject if relist else event_subject
        self._headers = provenance_headers(provenance)

    async def publish(self, event: BaseCloudEvent) -> None:
        if not self._headers:
            # A claim from outside: a consumer that believed the extension (another tool
            # on the subject, a future reader) would skip the read before a DELETE.
            event = unclaimed(event)
        subject = self._subject(event.get_type())
        await publish_event(self._js, subject, self._stream, event, self._headers)


def provenance_headers(provenance: Provenance) -> dict[str, str]:
    """The headers that say a message's `provenance` (lapse's mark, or none). Checked at
    run time too: a bool here (the old `observed=True`) must fail, not pass for a claim or,
    worse, for a read."""
    if not isinstance(provenance, Provenance):
        raise TypeError(f"provenance must be a Provenance, not {type(provenance).__name__}")
    return observed_mark() if provenance is Provenance.READ_BY_LAPSE else {}


# JetStream's answer when a message with the same Nats-Msg-Id is being stored right now
# (replicated streams: another lapse published the same event a moment earlier).
DUPLICATE_IN_PROCESS = 10158
# Waits before publishing again meanwhile: by then the other copy is stored (and ours is
# acknowledged as its duplicate), or it failed (and ours is stored).
IN_PROCESS_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


async def publish_event(
    js: JetStreamContext,
    subject: str,
    stream: str,
    event: BaseCloudEvent,
    headers: Mapping[str, str] | None = None,
) -> None:
    with send_span(subject, event) as hop:
        message = encode(event, hop)
        sent = {**message.headers, **(headers or {})}
        for wait in (*IN_PROCESS_RETRIES, None):
            try:
                await js.publish(subject, message.body, stream=stream, headers=sent)
                return
            except APIError as exc:
                if exc.err_code != DUPLICATE_IN_PROCESS or wait is None:
                    raise
            await asyncio.sleep(wait)


def encode(event: BaseCloudEvent, hop: HopContext) -> NatsMessage:
    return to_nats(event, hop_traceparent=hop.traceparent, hop_tracestate=hop.tracestate)
