"""HTTP ingress: CloudEvents pushed by Knative ApiServerSource, Tekton or anyone else.

A request is answered 202 only after JetStream has stored the event, so a sender that got
202 may forget it; 400 says why the input is unusable (nothing is stored); 503 asks the
sender to retry (NATS unavailable). Input is checked with the same adapters the planner
uses, so a malformed Workflow is refused at the door instead of dead-lettered later.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import HTTPMessage, from_http_event

from events.adapters import Ignored, adapt_cloudevent
from events.builder import parse_payload
from events.errors import InvalidEvent
from events.types import EventType
from lapse.runtime.asgi import Receive, Scope, Send, lifespan, respond
from lapse.telemetry import server_span

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024  # Workflows with large status can be big; etcd's limit is 1.5 MiB

Publish = Callable[[BaseCloudEvent], Awaitable[None]]

LAPSE_RUN_TYPES = (EventType.RUN_FINISHED, EventType.RUN_DELETED)


def check(event: BaseCloudEvent) -> str | None:
    """Raise InvalidEvent if the event cannot be used; a reason string if it needs no action."""
    if event.get_type() in LAPSE_RUN_TYPES:
        parse_payload(event)
        return None
    result = adapt_cloudevent(event)
    return result.reason if isinstance(result, Ignored) else None


class Ingress:
    """An ASGI application: POST / with a CloudEvent (binary or structured mode)."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in ("/healthz", "/readyz"):
            await respond(send, 200, "ok")
            return
        if scope["method"] != "POST":
            await respond(send, 405, "POST a CloudEvent")
            return
        body = await _body(receive)
        if body is None:
            await respond(send, 413, f"body larger than {MAX_BODY} bytes")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            event = from_http_event(HTTPMessage(headers=headers, body=body))
        except Exception as exc:  # the SDK raises several types for unusable input
            await respond(send, 400, f"not a CloudEvent: {exc}")
            return
        try:
            ignored = check(event)
        except InvalidEvent as exc:
            await respond(send, 400, exc.reason)
            return
        if ignored is not None:
            await respond(send, 202, f"ignored: {ignored}")
            return
        # The sender's traceparent parents this hop, so the publish (and everything after
        # it) continues the sender's trace instead of starting a new one.
        with server_span(event, scope["headers"], method="POST", path=scope["path"]):
            try:
                await self._publish(event)
            except Exception as exc:
                log.warning("ingress: could not store %s: %s", event.get_id(), exc)
                await respond(send, 503, "event store unavailable, retry later")
                return
        await respond(send, 202, "")


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
