"""In-memory stand-ins for the handlers' ports, for unit tests of what a handler decides.

The real edges behind these ports (NATS message schedules) are tested against real
servers in tests/integration/; a unit test only asks what the handler does with each
answer.
"""

from __future__ import annotations

from datetime import datetime

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import parse_payload
from lapse.events.models import CleanupDue
from lapse.events.run import Target
from lapse.functions.ports import PendingSchedule
from lapse.functions.trust import Provenance


class FakeSchedules:
    """What lapse stored, per (target, uid): the ScheduleStore port held in memory (the
    NATS edge is tested against a real server in tests/integration/test_row_reaper.py)."""

    def __init__(self) -> None:
        self.stored: dict[tuple[Target, str], PendingSchedule] = {}
        self.puts: list[tuple[Target, str, datetime, CleanupDue]] = []

    def fired(self, event: BaseCloudEvent) -> BaseCloudEvent:
        payload = parse_payload(event, CleanupDue)
        key = (payload.target, payload.run.uid)
        self.stored[key] = PendingSchedule(*key, payload.deadline, fired=True, due=payload)
        return event

    async def get(
        self, target: Target, uid: str, *, with_due: bool = False
    ) -> PendingSchedule | None:
        return self.stored.get((target, uid))

    async def put(
        self,
        target: Target,
        uid: str,
        deadline: datetime,
        due_event: BaseCloudEvent,
        *,
        provenance: Provenance,
    ) -> None:
        payload = parse_payload(due_event, CleanupDue)
        self.puts.append((target, uid, deadline, payload))
        self.stored[(target, uid)] = PendingSchedule(target, uid, deadline, due=payload)

    async def cancel(self, target: Target, uid: str) -> bool:
        return self.stored.pop((target, uid), None) is not None
