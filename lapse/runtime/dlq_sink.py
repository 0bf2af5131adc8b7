"""The dead-letter sink of the Knative Broker (`lapse-dlq-sink`, infra/knative/dlq-sink.yaml).

When the Broker gives up on an event (its Trigger's retries are spent, or a function
answered a 4xx it would answer again), it POSTs the event here with extensions saying why
(`knativeerrorcode`, `knativeerrordest`, `knativeerrordata`). The sink stores it in lapse's
dead letters as a `cleanup.failed` with stage `broker` and the event captured as its
original, through the same emitter the dispatcher uses (audit trail and DLQ), so `lapse dlq
list|show|replay` treat it like any other dead letter: a due event is replayed onto its
`lapse.due.<target>.<uid>`. It answers 202 only after JetStream stored the record, 503 while
NATS is away (the Broker retries), 400 for a body that is not a CloudEvent.

Run as `python -m lapse.runtime.dlq_sink --listen HOST:PORT` (the lapse image).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Final

import hypercorn.asyncio
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import HTTPMessage, from_http_event

from lapse.config import LapseConfig, load_config
from lapse.config.redact import RedactingFilter
from lapse.events.builder import build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue, CleanupFailed
from lapse.events.original import capture_event
from lapse.events.types import EventType
from lapse.runtime import shutdown
from lapse.runtime.asgi import Receive, Scope, Send, posted_headers, respond, server_config
from lapse.runtime.resources import Resources

log = logging.getLogger(__name__)

SOURCE: Final = "/lapse/dlq-sink"
STAGE: Final = "broker"
# A dead letter is one event; anything larger is not one the Broker delivered.
MAX_BODY_BYTES: Final = 4 * 1024 * 1024

Emit = Callable[[BaseCloudEvent], Awaitable[None]]


def dead_letter(event: BaseCloudEvent) -> BaseCloudEvent:
    """The `cleanup.failed` recording what the Broker gave up on, and why."""
    attributes = event.get_attributes()
    code = attributes.get("knativeerrorcode", "no code")
    where = attributes.get("knativeerrordest", "its subscriber")
    reason = f"the Knative Broker gave up delivering it to {where} (last answer: {code})"
    failed = CleanupFailed(reason=reason, stage=STAGE, original=capture_event(event))
    if event.get_type() == EventType.CLEANUP_DUE:
        with contextlib.suppress(InvalidEvent):
            due = parse_payload(event)
            if isinstance(due, CleanupDue):
                failed = failed.model_copy(update={"run": due.run, "target": due.target})
    return build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed)


class DeadLetterSink:
    """An ASGI application: POST / with a dead-lettered CloudEvent; /healthz, /readyz."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = await posted_headers(scope, receive, send)
        if headers is None:
            return
        body = await _body(receive)
        try:
            event = from_http_event(HTTPMessage(headers=headers, body=body))
        except Exception as exc:  # the SDK raises several types for unusable input
            await respond(send, 400, f"not a CloudEvent: {exc}")
            return
        try:
            await self._emit(dead_letter(event))
        except Exception as exc:
            log.warning("dlq-sink: could not store %s: %s", event.get_id(), exc)
            await respond(send, 503, "dead letters unavailable, retry later", retry_after=1)
            return
        log.info("dlq-sink: stored %s (%s)", event.get_id(), event.get_type())
        await respond(send, 202, "")


async def _body(receive: Receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def serve(config: LapseConfig, listen: str, stop: asyncio.Event) -> None:
    async with Resources(config) as resources:
        sink = DeadLetterSink((await resources.emitter()).emit)
        settings = server_config(listen)
        await hypercorn.asyncio.serve(sink, settings, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lapse.runtime.dlq_sink", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())  # a URL in a log line, never its secret
    config = load_config()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await serve(config, args.listen, stop)
        finally:
            shutdown.guard(loop)  # asyncio.run then waits for what is left

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
