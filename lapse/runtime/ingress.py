"""HTTP ingress: CloudEvents pushed by Knative ApiServerSource, Tekton or anyone else.

A request is answered 202 only after JetStream has stored the event, so a sender that got
202 may forget it. The sender's fault is a 4xx, never a 5xx (a Broker retries 5xx forever):
- 413: the body is over `ingress.max_body_bytes`, or the event, re-encoded with its
  headers, would not fit in the NATS server's max_payload;
- 400: not a CloudEvent, or an event the adapters refuse (the reason says why);
- 401: a token is configured (`ingress.token_file`) and the request does not carry it as
  `Authorization: Bearer <token>`; nothing of the request is read or kept;
- 422: a usable event of a type no running handler consumes (`pushed_types`): stored, it
  would be read by no one, so the 202 would be a lie;
- 503 only for lapse's own trouble: NATS unavailable, retry later.
Input is checked with the same adapters the planner uses, so a malformed Workflow is
refused at the door instead of dead-lettered later. What the sender claims about itself
is not passed on: the publisher drops the `lapseobserved` extension (events/observed.py).

Listening beyond loopback needs a token (`listen_token`): `lapse up --listen 0.0.0.0:8080`
without `ingress.token_file` does not start.

Every refusal is counted (`lapse.ingress.rejections`) and recorded, bounded: a
`dev.lapse.cleanup.failed.v1` with stage `ingress`, the reason and the bounded original
(`events/original.py`) goes to the audit trail and the DLQ, at most
`ingress.max_records_per_minute`; refusals beyond that are counted, and the next record
says how many were not recorded. The answer is sent before the record is written: a slow
NATS never delays a sender's 4xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Final

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import HTTPMessage, from_http_event
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from lapse.config import ConfigError, LapseConfig
from lapse.config.schema import DEFAULT_MAX_BODY_BYTES, IngressConfig
from lapse.edges.nats import max_payload
from lapse.edges.publishing import NatsEmitter, NatsPublisher
from lapse.events.adapters import Ignored, adapt_cloudevent
from lapse.events.builder import build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import MAX_ORIGINAL_DATA_CHARS, CleanupFailed, OriginalEvent
from lapse.events.nats_binding import to_nats
from lapse.events.original import capture_event, capture_message
from lapse.events.types import EventType
from lapse.functions.ratelimit import TokenBucket
from lapse.functions.trust import Provenance
from lapse.runtime.asgi import Receive, Scope, Send, posted_headers, respond
from lapse.runtime.routing import Route, load_routes, pushed_types
from lapse.telemetry import names, server_span
from lapse.telemetry.providers import instruments

log = logging.getLogger(__name__)

SOURCE: Final = "/lapse/ingress"
STAGE: Final = "ingress"
# Room for the headers the hop adds (traceparent, tracestate of at most 512 characters)
# and NATS's own header framing, on top of what `to_nats` makes of the event.
HEADER_ROOM: Final = 1024
# An oversized body is read to its end (and dropped) up to this many times the limit.
DRAIN_FACTOR: Final = 16
# How long writing one record may take after the answer was sent.
RECORD_TIMEOUT: Final = 5.0
# JetStream's error code for a message over the stream's max_msg_size.
MESSAGE_TOO_LARGE: Final = 10054

Publish = Callable[[BaseCloudEvent], Awaitable[None]]
Record = Callable[[BaseCloudEvent], Awaitable[None]]

LAPSE_RUN_TYPES = (EventType.RUN_FINISHED, EventType.RUN_DELETED)
TOKEN_KEY: Final = "ingress.token_file"
# Names `--listen` may use that reach this machine only.
LOOPBACK_NAMES: Final = frozenset({"localhost"})


def check(event: BaseCloudEvent) -> str | None:
    """Raise InvalidEvent if the event cannot be used; a reason string if it needs no action."""
    if event.get_type() in LAPSE_RUN_TYPES:
        parse_payload(event)
        return None
    result = adapt_cloudevent(event)
    return result.reason if isinstance(result, Ignored) else None


def is_loopback(listen: str) -> bool:
    """Whether `HOST:PORT` (hypercorn's bind syntax) listens on this machine only. Anything
    not plainly loopback (0.0.0.0, ::, a host name, a unix socket) counts as reachable."""
    host, sep, _ = listen.rpartition(":")
    if not sep:
        return False
    host = host.removeprefix("[").removesuffix("]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_token(listen: str | None, config: IngressConfig) -> str | None:
    """The bearer token the ingress on `listen` requires (None: open, on loopback only).
    `ConfigError` naming the key when it listens beyond loopback without one, or the file
    cannot be read; the message never contains the file's content."""
    if config.token_file is None:
        if listen and not is_loopback(listen):
            raise ConfigError(
                [
                    f"{TOKEN_KEY}: required to listen on {listen}, beyond loopback "
                    "(a file holding a bearer token; LAPSE_INGRESS__TOKEN_FILE), "
                    "or --listen 127.0.0.1:PORT"
                ]
            )
        return None
    return read_token(config.token_file)


def read_token(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError([f"{TOKEN_KEY}: cannot read {path}: {why}"]) from None
    token = text.strip()  # a Secret written with `echo` ends in a newline
    if not token:
        raise ConfigError([f"{TOKEN_KEY}: {path} is empty"])
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError([f"{TOKEN_KEY}: {path}: white space or control characters in the token"])
    return token


class _Refused(Exception):
    """One refusal: the status, the reason given to the sender, what it looked like (None:
    nothing of it is kept, as for a sender that did not authenticate)."""

    def __init__(self, status: int, kind: str, reason: str, original: OriginalEvent | None) -> None:
        super().__init__(reason)
        self.status = status
        self.kind = kind
        self.reason = reason
        self.original = original


class Ingress:
    """An ASGI application: POST / with a CloudEvent (binary or structured mode).

    `max_payload` is the NATS server's limit (headers and body), when known; `record`
    stores a refusal's `cleanup.failed` (the emitter: audit trail and DLQ). `accepted`:
    the event types it stores, those a handler consumes (default: every type the Trigger
    file routes to `lapse.events`); `token`: the bearer token a request must carry.
    """

    def __init__(
        self,
        publish: Publish,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_payload: int | None = None,
        record: Record | None = None,
        max_records_per_minute: int = 60,
        clock: Callable[[], float] = time.monotonic,
        accepted: frozenset[str] | None = None,
        token: str | None = None,
    ) -> None:
        self._publish = publish
        self.accepted = accepted if accepted is not None else pushed_types(load_routes())
        # Compared as digests: equal length whatever was sent, so neither the comparison
        # (hmac.compare_digest) nor its length check says anything about the token.
        self._token_digest = _digest(token) if token is not None else None
        self.max_body_bytes = max_body_bytes
        self._max_payload = max_payload
        self._record = record
        self._clock = clock
        rate = max_records_per_minute / 60.0
        self._bucket = TokenBucket(rate, burst=max_records_per_minute, now=clock())
        self._unrecorded = 0
        self._recording: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = await posted_headers(scope, receive, send)
        if headers is None:
            return
        if (unauthorized := self._unauthorized(headers)) is not None:
            # Before the body is read: nothing an unauthenticated sender sent is parsed,
            # stored or recorded, only that it tried and from where.
            await _challenge(send, unauthorized)
            peer = _peer(scope)
            self._refused(_Refused(401, "unauthorized", f"{unauthorized} (from {peer})", None))
            return
        try:
            event, ignored = await self._accept(headers, receive)
        except _Refused as refused:
            await respond(send, refused.status, refused.reason)
            self._refused(refused)
            return
        if ignored is not None:
            await respond(send, 202, f"ignored: {ignored}")
            return
        # The sender's traceparent parents this hop, so the publish (and everything after
        # it) continues the sender's trace instead of starting a new one.
        with server_span(event, scope["headers"], method="POST", path=scope["path"]):
            try:
                await self._publish(event)
            except (MaxPayloadError, APIError) as exc:
                if isinstance(exc, APIError) and exc.err_code != MESSAGE_TOO_LARGE:
                    log.warning("ingress: could not store %s: %s", event.get_id(), exc)
                    await respond(send, 503, "event store unavailable, retry later")
                    return
                too_large = _Refused(
                    413, "too_large", self._too_large_for_nats(), capture_event(event)
                )
                await respond(send, 413, too_large.reason)
                self._refused(too_large)
                return
            except Exception as exc:
                log.warning("ingress: could not store %s: %s", event.get_id(), exc)
                await respond(send, 503, "event store unavailable, retry later")
                return
        await respond(send, 202, "")

    async def _accept(
        self, headers: Mapping[str, str], receive: Receive
    ) -> tuple[BaseCloudEvent, str | None]:
        """The usable event and, if it needs no action, why; `_Refused` otherwise."""
        body, complete = await _body(receive, self.max_body_bytes)
        if not complete:
            raise _Refused(
                413,
                "too_large",
                f"body larger than {self.max_body_bytes} bytes (ingress.max_body_bytes)",
                _captured(headers, body),
            )
        try:
            event = from_http_event(HTTPMessage(headers=dict(headers), body=body))
        except Exception as exc:  # the SDK raises several types for unusable input
            raise _Refused(
                400, "not_cloudevent", f"not a CloudEvent: {exc}", _captured(headers, body)
            ) from None
        try:
            ignored = check(event)
        except InvalidEvent as exc:
            raise _Refused(400, "invalid", exc.reason, capture_event(event)) from None
        except Exception as exc:  # an adapter tripping on odd input is still the input's fault
            log.exception("ingress: checking %s failed", event.get_id())
            raise _Refused(
                400, "invalid", f"unusable event: {type(exc).__name__}: {exc}", capture_event(event)
            ) from None
        if ignored is None and self._max_payload is not None:
            try:
                size = _message_size(event)
            except InvalidEvent as exc:  # cannot be put in NATS headers at all
                raise _Refused(400, "invalid", exc.reason, capture_event(event)) from None
            if size + HEADER_ROOM > self._max_payload:
                raise _Refused(413, "too_large", self._too_large_for_nats(), capture_event(event))
        if ignored is None and event.get_type() not in self.accepted:
            # Usable, but stored it would wait on `lapse.events.<type>` for a consumer that
            # does not exist: refused, so the sender knows nothing will happen.
            raise _Refused(
                422,
                "unrouted",
                f"no handler here takes {event.get_type()!r} (no route in "
                "infra/knative/triggers.yaml or an opt-in Component's trigger.yaml, or its "
                "function is not running)",
                capture_event(event),
            )
        return event, ignored

    def _unauthorized(self, headers: Mapping[str, str]) -> str | None:
        """Why the request is not authorized, or None. The presented value is never part
        of the answer: it may be a real token sent to the wrong place."""
        if self._token_digest is None:
            return None
        scheme, _, presented = headers.get("authorization", "").strip().partition(" ")
        if not scheme:
            return "no bearer token"
        if scheme.lower() != "bearer":
            return "Authorization is not a bearer token"
        if not hmac.compare_digest(_digest(presented.strip()), self._token_digest):
            return "wrong bearer token"
        return None

    def _too_large_for_nats(self) -> str:
        limit = f" ({self._max_payload} bytes)" if self._max_payload is not None else ""
        return f"event too large for the NATS server's max_payload{limit} once encoded"

    # --- the record of a refusal ------------------------------------------------------------

    def _refused(self, refused: _Refused) -> None:
        recorded = self._record is not None and self._bucket.delay(self._clock()) == 0.0
        instruments().ingress_rejections.add(
            1,
            {
                names.HTTP_STATUS: refused.status,
                names.INGRESS_REJECTION: refused.kind,
                names.INGRESS_RECORDED: recorded,
            },
        )
        if not recorded:
            self._unrecorded += 1
            log.info("ingress: refused (%d, not recorded): %s", refused.status, refused.reason)
            return
        self._bucket.reserve(self._clock())
        reason = f"{refused.status}: {refused.reason}"
        if self._unrecorded:
            reason += f" ({self._unrecorded} more refusals not recorded before this one)"
            self._unrecorded = 0
        failed = CleanupFailed(reason=reason, stage=STAGE, attempts=1, original=refused.original)
        event = build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed)
        # After the answer: the sender is not kept waiting on the record.
        task = asyncio.get_running_loop().create_task(self._write(event))
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    async def _write(self, event: BaseCloudEvent) -> None:
        assert self._record is not None
        try:
            await asyncio.wait_for(self._record(event), RECORD_TIMEOUT)
        except Exception as exc:
            log.warning("ingress: could not record a refusal: %s", exc)

    async def flush(self) -> None:
        """Wait for the records being written (tests, shutdown)."""
        if self._recording:
            await asyncio.wait(set(self._recording))


async def nats_ingress(
    js: JetStreamContext,
    config: LapseConfig,
    *,
    listen: str | None = None,
    routes: list[Route] | None = None,
) -> Ingress:
    """The ingress `lapse up` serves on `listen`: publishes to `lapse.events.<type>` the
    types `routes` consume (default: every route in the Trigger file), records refusals
    through the emitter. A limit above what the NATS server accepts, or a listen address
    beyond loopback without a token, is refused here, at start-up (`ConfigError` naming
    the key), not discovered later."""
    token = listen_token(listen, config.ingress)
    server_limit = max_payload(js)
    limit = config.ingress.max_body_bytes
    if server_limit is not None and limit > server_limit:
        raise ConfigError(
            [
                f"ingress.max_body_bytes: {limit} is above the NATS server's max_payload "
                f"({server_limit}); lower it or raise max_payload on the server"
            ]
        )
    streams = config.nats.streams
    return Ingress(
        # What a sender says of itself is a claim: it is published unmarked.
        NatsPublisher(js, streams, provenance=Provenance.CLAIMED).publish,
        max_body_bytes=limit,
        max_payload=server_limit,
        record=NatsEmitter(js, streams).emit,
        max_records_per_minute=config.ingress.max_records_per_minute,
        accepted=pushed_types(routes if routes is not None else load_routes()),
        token=token,
    )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).digest()


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}" if client else "an unknown address"


async def _challenge(send: Send, why: str) -> None:
    """401 with the challenge RFC 6750 asks for; `invalid_token` when one was presented."""
    challenge = 'Bearer realm="lapse"'
    if why == "wrong bearer token":
        challenge += ', error="invalid_token"'
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"www-authenticate", challenge.encode()),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": why.encode()})


def _message_size(event: BaseCloudEvent) -> int:
    """Bytes NATS counts against max_payload for this event: body and header block."""
    message = to_nats(event)
    framing = len("NATS/1.0\r\n") + 2
    return (
        len(message.body) + framing + sum(len(k) + len(v) + 4 for k, v in message.headers.items())
    )


def _captured(headers: Mapping[str, str], body: bytes) -> OriginalEvent:
    """A refused body, bounded before it is even decoded (a body may be megabytes)."""
    cut = body[: 4 * MAX_ORIGINAL_DATA_CHARS]
    original = capture_message(headers, cut)
    if len(cut) < len(body) and not original.truncated:
        original = original.model_copy(update={"truncated": True})
    return original


async def _body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body, and whether it is complete (False: it went over `limit`; what was read
    up to the limit is returned, for the record)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            chunks.append(chunk[: max(0, limit - (size - len(chunk)))])
            if message.get("more_body"):
                await _discard(receive, size, DRAIN_FACTOR * limit)
            return b"".join(chunks), False
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks), True


async def _discard(receive: Receive, size: int, cap: int) -> None:
    """Read and drop the rest of an oversized body, so the sender reads a 413 rather than
    a reset connection; past `cap` the answer goes out anyway."""
    while size <= cap:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            return
