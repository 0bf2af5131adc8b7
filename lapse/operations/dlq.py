"""The dead letters (`LAPSE_DLQ`): reading, replaying and purging them (`lapse dlq`).

Every entry is a `dev.lapse.cleanup.failed.v1` event: the reason, the stage that gave up,
the run and target when known, and `original`, the input that failed, captured bounded
(`events/original.py`). An entry's ID is its stream sequence number.

Replay sends the original back to where its route consumes it, as a new event (a new id,
`<original id>.replay.<seq>`; the same id would be dropped by JetStream's duplicate window
or read as a repeat of an event that already has its outcome):
- a due event (`cleanup.due`, target kubernetes or database) is published on
  `lapse.due.<target>.<uid>`, exactly where the NATS scheduler fires it, so the reaper
  handles it at once and walks the whole safety sequence again (fresh read, uid and
  resourceVersion preconditions): an object deleted meanwhile is `already_gone`, one whose
  deadline moved is `rescheduled`, none is deleted twice;
- any other event a route consumes (run lifecycle events, engine events) is published on
  `lapse.events.<type>` for the planner.
Entries for the same due deadline (target, uid) are replayed once. Only after the publish
was stored is the entry removed from the dead letters, so a replay interrupted half-way
repeats a publish (harmless: the reaper is idempotent) and never loses one. The audit
stream keeps its own copy of every failure, so removing an entry erases no history.

A due event is replayed only as lapse stored it: the due message the scheduler fired (kept
on `lapse.due.<target>.<uid>` for `due_message_ttl`) for the run and target the entry
names, never a captured due event, which is whatever its sender wrote (docs/security.md).
Any other event is the entry's `original` when it was captured whole. An entry with
neither, or whose input was not a CloudEvent, cannot be replayed: it is reported and left
in place (`lapse reconcile` re-derives deadlines from the objects themselves).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from lapse.config import Streams
from lapse.edges.publishing import encode
from lapse.edges.streams import due_message_ttl, read_stream
from lapse.errors import LapseError
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue, CleanupFailed, OriginalEvent
from lapse.events.nats_binding import encode_header_value, from_nats
from lapse.events.run import Target
from lapse.events.subjects import DLQ_PREFIX, due_subject, event_subject
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType
from lapse.runtime.routing import Route, load_routes
from lapse.telemetry import send_span

# The per-message TTL a fired due message carries (the scheduler sets it from
# Nats-Schedule-TTL); a replayed one expires the same way.
MSG_TTL_HEADER: Final = "Nats-TTL"
_HEADERS_AS_IS: Final = frozenset({"content-type", "nats-msg-id", "traceparent", "tracestate"})


class DeadLetterNotFound(LapseError):
    """No dead letter has this ID."""


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the DLQ. `failed` is None when the entry is not a readable
    `cleanup.failed` (then `problem` says why)."""

    seq: int
    event: BaseCloudEvent | None
    failed: CleanupFailed | None
    problem: str | None = None

    @property
    def id(self) -> str:
        return str(self.seq)

    def row(self) -> dict[str, Any]:
        """A flat row for a table or JSON: what failed, where, and why."""
        failed = self.failed
        run = failed.run if failed else None
        original = failed.original if failed else None
        time = self.event.get_time() if self.event is not None else None
        return {
            "id": self.seq,
            "time": format_rfc3339(time) if time else None,
            "namespace": run.namespace if run else None,
            "name": run.name if run else None,
            "uid": run.uid if run else None,
            "target": failed.target.value if failed and failed.target else None,
            "stage": failed.stage if failed else None,
            "attempts": failed.attempts if failed else None,
            "reason": failed.reason if failed else self.problem,
            "originalType": original.attributes.get("type") if original else None,
        }

    def document(self) -> dict[str, Any]:
        """Everything stored for `lapse dlq show`: the row, the event, the original."""
        event = self.event
        attributes = (
            {k: _text(v) for k, v in event.get_attributes().items()} if event is not None else {}
        )
        return {
            **self.row(),
            "event": {"attributes": attributes, "data": event.get_data() if event else None},
            "original": (
                self.failed.original.model_dump(mode="json", by_alias=True)
                if self.failed and self.failed.original
                else None
            ),
        }


@dataclass(frozen=True)
class Filter:
    """Which dead letters an operation applies to; every given field must match."""

    namespace: str | None = None
    name: str | None = None
    target: str | None = None
    stage: str | None = None
    reason: str | None = None  # a substring of the reason, case-insensitive
    since: datetime | None = None  # stored at or after (the server filters on it)
    ids: frozenset[int] = frozenset()

    @property
    def narrows(self) -> bool:
        """Whether anything was asked for at all (purge refuses to run on nothing)."""
        return any(
            value is not None
            for value in (self.namespace, self.name, self.target, self.stage, self.reason)
        ) or bool(self.ids or self.since)

    def matches(self, letter: DeadLetter) -> bool:
        if self.ids and letter.seq not in self.ids:
            return False
        row = letter.row()
        for key in ("namespace", "name", "target", "stage"):
            wanted = getattr(self, key)
            if wanted is not None and row[key] != wanted:
                return False
        if self.reason is not None:
            return self.reason.lower() in str(row["reason"] or "").lower()
        return True


async def dead_letters(
    js: JetStreamContext, stream: str, selection: Filter = Filter()
) -> AsyncIterator[DeadLetter]:
    """The dead letters that match, oldest first."""
    start = min(selection.ids) if selection.ids and selection.since is None else None
    async for seq, headers, body in read_stream(
        js, stream, f"{DLQ_PREFIX}.>", since=selection.since, start_seq=start
    ):
        letter = _letter(seq, headers, body)
        if selection.matches(letter):
            yield letter


async def dead_letter(js: JetStreamContext, stream: str, ident: str) -> DeadLetter:
    """One dead letter by ID (its sequence number) or by its event id."""
    if ident.isdigit():
        try:
            msg = await js.get_msg(stream, int(ident))
        except NotFoundError:
            raise DeadLetterNotFound(f"no dead letter {ident} in {stream}") from None
        if not (msg.subject or "").startswith(f"{DLQ_PREFIX}."):
            raise DeadLetterNotFound(f"no dead letter {ident} in {stream}")
        return _letter(msg.seq or int(ident), dict(msg.headers or {}), msg.data or b"")
    async for letter in dead_letters(js, stream):
        if letter.event is not None and letter.event.get_id() == ident:
            return letter
    raise DeadLetterNotFound(f"no dead letter with ID or event id {ident!r} in {stream}")


def _letter(seq: int, headers: dict[str, str], body: bytes) -> DeadLetter:
    try:
        event = from_nats(headers, body)
    except InvalidEvent as exc:
        return DeadLetter(seq, None, None, f"not a CloudEvent: {exc.reason}")
    try:
        failed = parse_payload(event, CleanupFailed)
    except InvalidEvent as exc:
        return DeadLetter(seq, event, None, f"not a cleanup.failed event: {exc.reason}")
    return DeadLetter(seq, event, failed)


# --- replay -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    subject: str
    stream: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ReplayReport:
    replayed: list[dict[str, Any]] = field(default_factory=list)  # one per event sent
    removed: list[int] = field(default_factory=list)  # entries taken out of the DLQ
    left: list[dict[str, Any]] = field(default_factory=list)  # not replayable, and why
    dry_run: bool = False

    def summary(self) -> dict[str, Any]:
        return {
            "dryRun": self.dry_run,
            "replayed": self.replayed,
            "removed": self.removed,
            "left": self.left,
        }


async def original_event(
    js: JetStreamContext, streams: Streams, letter: DeadLetter
) -> BaseCloudEvent:
    """The CloudEvent that failed; InvalidEvent if it cannot be had faithfully.

    A due event (`cleanup.due`) is replayed only as lapse stored it: the due message the
    scheduler fired, still kept on `lapse.due.<target>.<uid>` for `due_message_ttl`, for
    the run and target the entry names (or its captured original names). A captured due
    event is whatever its sender wrote (an ingress refusal keeps a forged one whole), and
    replayed as lapse's identity it would become what the row-reaper proves its deadline
    from (docs/security.md). Any other event is its captured original, when it was kept
    whole.
    """
    if letter.failed is None:
        raise InvalidEvent(letter.problem or "not a cleanup.failed event")
    failed = letter.failed
    original = failed.original
    captured: BaseCloudEvent | None = None
    if original is not None and not original.truncated:
        headers, body = _message(original)
        captured = from_nats(headers, body)
        if captured.get_type() != EventType.CLEANUP_DUE:
            return captured
    target, uid = _due_of(failed, captured)
    if target is not None and uid is not None:
        try:
            msg = await js.get_last_msg(streams.schedule, due_subject(target, uid))
        except NotFoundError:
            pass
        else:
            return from_nats(dict(msg.headers or {}), msg.data or b"")
    if captured is not None:
        raise InvalidEvent(
            "nothing to replay: lapse stored no due message for this run, and a due event is "
            "replayed only as lapse stored it, never as it was sent; `lapse reconcile` "
            "re-derives deadlines from the objects that exist"
        )
    cut = " (the original was cut to bound the dead letters)" if original is not None else ""
    raise InvalidEvent(
        f"nothing to replay{cut}: no due message is kept for this run; `lapse reconcile` "
        "re-derives its deadlines from the objects that exist"
    )


def _due_of(
    failed: CleanupFailed, captured: BaseCloudEvent | None
) -> tuple[Target | None, str | None]:
    """The (target, uid) whose stored due message stands for this entry."""
    if captured is not None:
        due = parse_payload(captured, CleanupDue)
        return due.target, due.run.uid
    if failed.run is not None and failed.target is not None:
        return failed.target, failed.run.uid
    return None, None


def _message(original: OriginalEvent) -> tuple[dict[str, str], bytes]:
    """The original as a binary-mode NATS message. `capture_event` keeps attribute names,
    `capture_message` kept the message's own headers (already encoded)."""
    names = original.attributes
    captured_headers = any(name.lower().startswith("ce-") for name in names)
    headers: dict[str, str] = {}
    for name, value in names.items():
        if captured_headers:
            if name.lower().startswith("ce-") or name.lower() in _HEADERS_AS_IS:
                headers[name] = value
        elif name == "datacontenttype":
            headers["content-type"] = value
        else:
            headers[f"ce-{name}"] = encode_header_value(value)
    return headers, (original.data or "").encode()


async def replay_problem(js: JetStreamContext, streams: Streams, letter: DeadLetter) -> str | None:
    """Why this entry cannot be replayed, or None."""
    try:
        destination(await original_event(js, streams, letter), streams, _routes())
    except InvalidEvent as exc:
        return exc.reason
    return None


@functools.cache
def _routes() -> tuple[Route, ...]:
    return tuple(load_routes())


def destination(event: BaseCloudEvent, streams: Streams, routes: Iterable[Route]) -> Destination:
    """Where a route consumes this event; InvalidEvent when no route does."""
    if event.get_type() == EventType.CLEANUP_DUE:
        due = parse_payload(event, CleanupDue)
        return Destination(
            due_subject(due.target, due.run.uid),
            streams.schedule,
            {MSG_TTL_HEADER: f"{int(due_message_ttl())}s"},
        )
    attributes = event.get_attributes()
    for route in routes:
        if route.matches(attributes) and route.stream(streams) == streams.events:
            return Destination(event_subject(str(event.get_type())), streams.events)
    raise InvalidEvent(f"no route consumes {event.get_type()} events: nothing to replay to")


def _replay_key(event: BaseCloudEvent) -> str:
    """Entries with the same key are one replay: one due deadline per (target, uid)."""
    if event.get_type() == EventType.CLEANUP_DUE:
        due = parse_payload(event, CleanupDue)
        return f"due:{due.target.value}:{due.run.uid}"
    return f"event:{event.get_id()}"


def renamed(event: BaseCloudEvent, seq: int) -> BaseCloudEvent:
    """The same event under the replay's own id."""
    attributes = {**event.get_attributes(), "id": f"{event.get_id()}.replay.{seq}"}
    return CloudEvent(attributes, event.get_data())


async def replay(
    js: JetStreamContext,
    streams: Streams,
    letters: Iterable[DeadLetter],
    *,
    dry_run: bool = False,
) -> ReplayReport:
    report = ReplayReport(dry_run=dry_run)
    routes = _routes()
    groups: dict[str, list[tuple[DeadLetter, BaseCloudEvent, Destination]]] = defaultdict(list)
    for letter in letters:
        try:
            event = await original_event(js, streams, letter)
            where = destination(event, streams, routes)
        except InvalidEvent as exc:
            report.left.append({**letter.row(), "problem": exc.reason})
            continue
        groups[_replay_key(event)].append((letter, event, where))
    for group in groups.values():
        # The newest entry of a group is sent: it is the latest state of that deadline.
        letter, event, where = group[-1]
        sent = renamed(event, letter.seq)
        report.replayed.append(
            {
                **letter.row(),
                "ids": [entry.seq for entry, _, _ in group],
                "subject": where.subject,
                "eventId": sent.get_id(),
            }
        )
        if dry_run:
            continue
        await _publish(js, where, sent)
        for entry, _, _ in group:
            await _remove(js, streams.dlq, entry.seq)
            report.removed.append(entry.seq)
    return report


async def _publish(js: JetStreamContext, where: Destination, event: BaseCloudEvent) -> None:
    with send_span(where.subject, event) as hop:
        message = encode(event, hop)
        headers = {**message.headers, **where.headers}
        await js.publish(where.subject, message.body, stream=where.stream, headers=headers)


async def _remove(js: JetStreamContext, stream: str, seq: int) -> None:
    # Removed meanwhile (another replay or purge): the goal is reached.
    with contextlib.suppress(NotFoundError):
        await js.delete_msg(stream, seq)


# --- purge --------------------------------------------------------------------------------


async def purge(
    js: JetStreamContext, stream: str, letters: Iterable[DeadLetter], *, dry_run: bool = False
) -> list[int]:
    """Remove these entries; returns their IDs (what would be removed, with `dry_run`)."""
    removed = []
    for letter in letters:
        if not dry_run:
            await _remove(js, stream, letter.seq)
        removed.append(letter.seq)
    return removed


def _text(value: object) -> str:
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return format_rfc3339(value)
    return str(value)
