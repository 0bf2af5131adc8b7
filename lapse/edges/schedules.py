"""The ScheduleStore port on NATS JetStream message schedules.

The due event is stored, in binary CloudEvents mode, on `lapse.sched.<target>.<uid>` with
`Nats-Schedule: @at <deadline>` and fired by the server onto `lapse.due.<target>.<uid>`.
The server rolls schedules up per subject, so putting again replaces; purging the subject
cancels. The server copies a schedule's headers onto the due message, so the reaper sees
both trace contexts (see lapse.edges.publishing).
"""

from __future__ import annotations

import time
from datetime import datetime

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerInfo, RawStreamMsg
from nats.js.errors import NotFoundError

from lapse.config import Streams
from lapse.edges.publishing import encode, provenance_headers
from lapse.edges.streams import due_message_ttl
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import from_nats
from lapse.events.run import Target
from lapse.events.subjects import (
    SCHEDULE_PREFIX,
    due_subject,
    schedule_or_due_subject,
    schedule_subject,
)
from lapse.events.timeutil import format_rfc3339, parse_rfc3339
from lapse.functions.ports import PendingSchedule
from lapse.functions.trust import Provenance
from lapse.telemetry import send_span

SCHEDULE_HEADER = "Nats-Schedule"
SCHEDULE_TARGET_HEADER = "Nats-Schedule-Target"
SCHEDULE_TTL_HEADER = "Nats-Schedule-TTL"
_AT = "@at "


def schedule_headers(deadline: datetime, target_subject: str) -> dict[str, str]:
    return {
        SCHEDULE_HEADER: _AT + format_rfc3339(deadline),
        SCHEDULE_TARGET_HEADER: target_subject,
        SCHEDULE_TTL_HEADER: f"{int(due_message_ttl())}s",
    }


# How long one snapshot of the schedule stream's consumers answers `_handled`. A consumer's
# ack floor only moves forward, so an older snapshot can only call a handled message "in
# hand" (nothing re-issued), never the reverse.
CONSUMERS_SNAPSHOT_SECONDS = 1.0


class NatsScheduleStore:
    """Schedules on JetStream. `get` also answers with a deadline that has already fired
    while its due message is still kept (Nats-Schedule-TTL).

    What a fired deadline counts as depends on who asks:
    - by default (the planner in `lapse up`, fed by the watcher's re-lists and updates) it
      counts as scheduled as long as its due message is kept: a re-list must not issue a
      second due event for a deadline the reapers have, nor repeat an outcome that was
      meant (kept, skipped, dry_run) or a refusal (403) on every re-list;
    - with `rederive_handled` (`lapse reconcile`, an operator's repair) it counts only while
      its due message is still in hand: not yet acknowledged by every durable consumer of
      its subject (the reapers ack once the handler returned, dead-lettered it, or the
      server gave up redelivering). A due message that was handled and whose object still
      exists is the lost deletion reconcile is for: its deadline is issued again.
    """

    def __init__(
        self, js: JetStreamContext, streams: Streams, *, rederive_handled: bool = False
    ) -> None:
        self._js = js
        self._stream = streams.schedule
        self._rederive_handled = rederive_handled
        self._consumers: tuple[float, list[ConsumerInfo]] | None = None
        self._direct_get: bool | None = None

    async def get(
        self, target: Target, uid: str, *, with_due: bool = False
    ) -> PendingSchedule | None:
        # One lookup answers both questions: the newest message on either subject of this
        # (target, uid) is its state. The server removes a schedule when it fires, and a
        # schedule put after a firing is newer than the due message it follows.
        msg = await self._last(schedule_or_due_subject(target, uid))
        if msg is None:
            return None
        if (msg.subject or "").startswith(SCHEDULE_PREFIX + "."):
            return _pending_of(msg, target, uid, with_due)
        fired = await self._fired(msg, target, uid)
        # The server removes a schedule when it fires it, so a due message newer than a
        # schedule still pending, for a later deadline, was not fired from it: it was
        # published on the due subject (`lapse dlq replay`, a replay). The deadline lapse
        # stored is the pending one; a replayed due event never stands for it.
        later = await self._last(schedule_subject(target, uid))
        pending = _pending_of(later, target, uid, with_due) if later is not None else None
        if pending is not None and (fired is None or pending.deadline > fired.deadline):
            return pending
        return fired

    async def _last(self, subject: str) -> RawStreamMsg | None:
        """The stream's last message on `subject` (wildcards allowed)."""
        try:
            return await self._js.get_last_msg(self._stream, subject, direct=await self._direct())
        except NotFoundError:
            return None

    async def _direct(self) -> bool:
        """Direct get (no JSON/base64 envelope) where it is also consistent: a stream with
        one replica. With more, any replica answers a direct get, and one a moment behind
        could miss a schedule just put or a due message just fired, and have the planner
        issue it again; the stream leader answers the classic get."""
        if self._direct_get is None:
            config = (await self._js.stream_info(self._stream)).config
            self._direct_get = bool(config.allow_direct) and (config.num_replicas or 1) == 1
        return self._direct_get

    async def _fired(self, msg: RawStreamMsg, target: Target, uid: str) -> PendingSchedule | None:
        due = _stored_due(msg)
        if due is None:
            return None
        subject = msg.subject or due_subject(target, uid)
        if self._rederive_handled and await self._handled(subject, msg.seq or 0):
            return None
        return PendingSchedule(target, uid, due.deadline, fired=True, due=due)

    async def _handled(self, subject: str, seq: int) -> bool:
        """Whether every durable consumer that takes `subject` has acknowledged stream
        message `seq`. No such consumer: the message waits for one, so it is in hand."""
        if seq <= 0:
            return False
        takers = [c for c in await self._durable_consumers() if _takes(c, subject)]
        return bool(takers) and all(_acknowledged(c, seq) for c in takers)

    async def _durable_consumers(self) -> list[ConsumerInfo]:
        now = time.monotonic()
        if self._consumers is None or now - self._consumers[0] > CONSUMERS_SNAPSHOT_SECONDS:
            infos = await self._js.consumers_info(self._stream)
            # Readers (lapse status, history) are ephemeral and acknowledge nothing: they
            # say nothing about whether a due message was handled.
            durable = [
                c
                for c in infos
                if c.config.durable_name and c.config.ack_policy is not AckPolicy.NONE
            ]
            self._consumers = (now, durable)
        return self._consumers[1]

    async def put(
        self,
        target: Target,
        uid: str,
        deadline: datetime,
        due_event: BaseCloudEvent,
        *,
        provenance: Provenance,
    ) -> None:
        subject = schedule_subject(target, uid)
        with send_span(subject, due_event) as hop:
            message = encode(due_event, hop)
            headers = {
                **message.headers,
                **schedule_headers(deadline, due_subject(target, uid)),
                # Copied by the server onto the due message: the reaper may then judge the
                # version this due event carries without reading it first.
                **provenance_headers(provenance),
            }
            # Nats-Msg-Id would make a later re-schedule with the same event id a duplicate;
            # replacement is what the subject roll-up is for, so the id is not sent here.
            headers.pop("Nats-Msg-Id", None)
            await self._js.publish(subject, message.body, stream=self._stream, headers=headers)

    async def cancel(self, target: Target, uid: str) -> bool:
        msg = await self._last(schedule_subject(target, uid))
        if msg is None or _pending_deadline(msg) is None:
            return False
        await self._js.purge_stream(self._stream, subject=schedule_subject(target, uid))
        return True


def _pending_of(
    msg: RawStreamMsg, target: Target, uid: str, with_due: bool
) -> PendingSchedule | None:
    """The pending schedule `msg` holds; `with_due`: with the due event lapse stored in it
    (where the run lives: the planner confirms a deletion claim by it). Parsing it costs
    about 0.1 ms, so the planner's re-plans, which only compare deadlines, do without."""
    deadline = _pending_deadline(msg)
    if deadline is None:
        return None
    return PendingSchedule(target, uid, deadline, due=_stored_due(msg) if with_due else None)


def _pending_deadline(msg: RawStreamMsg) -> datetime | None:
    spec = (msg.headers or {}).get(SCHEDULE_HEADER, "")
    return parse_rfc3339(spec[len(_AT) :]) if spec.startswith(_AT) else None


def _stored_due(msg: RawStreamMsg) -> CleanupDue | None:
    try:
        return parse_payload(from_nats(msg.headers, msg.data or b""), CleanupDue)
    except InvalidEvent:
        return None


def _takes(consumer: ConsumerInfo, subject: str) -> bool:
    filters = list(consumer.config.filter_subjects or [])
    if consumer.config.filter_subject:
        filters.append(consumer.config.filter_subject)
    return not filters or any(subject_matches(f, subject) for f in filters)


def _acknowledged(consumer: ConsumerInfo, seq: int) -> bool:
    floor = consumer.ack_floor.stream_seq if consumer.ack_floor else 0
    delivered = consumer.delivered.stream_seq if consumer.delivered else 0
    # Above the floor a message may be acked out of order or still pending; only "nothing
    # pending at all" settles it. Uncertain counts as in hand: nothing is issued twice.
    return (floor or 0) >= seq or (consumer.num_ack_pending == 0 and (delivered or 0) >= seq)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
