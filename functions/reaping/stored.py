"""The stored-schedule proof (pure), shared by the reapers whose run is gone by the time
they act (rows, artifacts): is a due event backed by the schedule lapse stored for this
(target, uid)?

Such a reaper cannot read the run object, so it never takes a due event's word for the
deadline or for which run it names: the deadline and the run are those of the schedule
lapse stored, the due message the server fired from it, or the schedule still pending
(docs/security.md, "The row-reaper"). `Backed` is that proof; the reaping sequence's
`Proven` (ports.py) is made from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, TypeAlias

from lapse.events.models import CleanupDue
from lapse.functions.ports import PendingSchedule

# The scheduler fires at the deadline; a due event earlier than this is a clock-skewed or
# hand-made one, and what is deleted early cannot be brought back.
EARLY_TOLERANCE: Final = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class Backed:
    """The deadline lapse stored has come: `due` is the stored due event's content."""

    due: CleanupDue


@dataclass(frozen=True, slots=True)
class NotYet:
    """The stored deadline is later than this due event: the stored schedule will fire."""

    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class Unbacked:
    """No schedule lapse stored backs this due event: nothing is deleted."""

    reason: str


StoredProof: TypeAlias = Backed | NotYet | Unbacked


def prove(claim: CleanupDue, stored: PendingSchedule | None, now: datetime) -> StoredProof:
    """Whether what `claim` names is due, from what lapse stored alone."""
    subject = f"{claim.run.subject} (uid {claim.run.uid})"
    if stored is None:
        return Unbacked(f"no schedule lapse stored backs this due event for {subject}")
    if stored.deadline - now > EARLY_TOLERANCE:
        return NotYet(
            stored.deadline,
            f"the deadline lapse stored for {subject} is {stored.deadline.isoformat()}",
        )
    if not stored.fired or stored.due is None:
        # Pending and due: the server fires it any moment, and that is the event to act on.
        return NotYet(stored.deadline, f"the schedule lapse stored for {subject} fires now")
    return Backed(stored.due)
