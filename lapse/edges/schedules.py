"""The ScheduleStore port on NATS JetStream message schedules.

The due event is stored, in binary CloudEvents mode, on `lapse.sched.<target>.<uid>` with
`Nats-Schedule: @at <deadline>` and fired by the server onto `lapse.due.<target>.<uid>`.
The server rolls schedules up per subject, so putting again replaces; purging the subject
cancels. The server copies a schedule's headers onto the due message, so the reaper sees
both trace contexts (see lapse.edges.publishing).
"""

from __future__ import annotations

from datetime import datetime

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from events.builder import parse_payload
from events.errors import InvalidEvent
from events.models import CleanupDue
from events.nats_binding import from_nats
from events.run import Target
from events.subjects import due_subject, schedule_subject
from events.timeutil import format_rfc3339, parse_rfc3339
from functions.ports import PendingSchedule
from lapse.config import Streams
from lapse.edges.publishing import encode
from lapse.edges.streams import due_message_ttl
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


class NatsScheduleStore:
    """Schedules on JetStream. `get` also answers with a deadline that has already fired
    while its due message is still kept (Nats-Schedule-TTL): the reapers have it, so a
    re-list or a reconcile that re-plans the same run must not issue a second one."""

    def __init__(self, js: JetStreamContext, streams: Streams) -> None:
        self._js = js
        self._stream = streams.schedule

    async def get(self, target: Target, uid: str) -> PendingSchedule | None:
        pending = await self._pending(target, uid)
        return pending if pending is not None else await self._fired(target, uid)

    async def _pending(self, target: Target, uid: str) -> PendingSchedule | None:
        try:
            msg = await self._js.get_last_msg(self._stream, schedule_subject(target, uid))
        except NotFoundError:
            return None
        spec = (msg.headers or {}).get(SCHEDULE_HEADER, "")
        if not spec.startswith(_AT):
            return None
        return PendingSchedule(target, uid, parse_rfc3339(spec[len(_AT) :]))

    async def _fired(self, target: Target, uid: str) -> PendingSchedule | None:
        try:
            msg = await self._js.get_last_msg(self._stream, due_subject(target, uid))
        except NotFoundError:
            return None
        try:
            due = parse_payload(from_nats(msg.headers, msg.data or b""), CleanupDue)
        except InvalidEvent:
            return None
        return PendingSchedule(target, uid, due.deadline)

    async def put(
        self, target: Target, uid: str, deadline: datetime, due_event: BaseCloudEvent
    ) -> None:
        subject = schedule_subject(target, uid)
        with send_span(subject, due_event) as hop:
            message = encode(due_event, hop)
            headers = {**message.headers, **schedule_headers(deadline, due_subject(target, uid))}
            # Nats-Msg-Id would make a later re-schedule with the same event id a duplicate;
            # replacement is what the subject roll-up is for, so the id is not sent here.
            headers.pop("Nats-Msg-Id", None)
            await self._js.publish(subject, message.body, stream=self._stream, headers=headers)

    async def cancel(self, target: Target, uid: str) -> bool:
        if await self._pending(target, uid) is None:
            return False
        await self._js.purge_stream(self._stream, subject=schedule_subject(target, uid))
        return True
