"""The row-reaper's judgements (pure): is a due event backed by what lapse stored, and what
the database's own account of the run means for it.

The row-reaper cannot read the run object (it is usually gone by the time its rows are
due), so it never takes a due event's word for the deadline or for which rows it names:
- `prove`: the deadline and the run are those of the schedule lapse stored for this
  (database, uid) — the due message the server fired from it, or the schedule still
  pending — never the event's own content (docs/security.md, "The row-reaper");
- `judge_facts`: inside the deleting transaction the database says whose run the rows are
  (the namespace the engine recorded), whether the run is still running, and when it
  finished; rows of another namespace's run are refused, a run that is running is kept, a
  run that finished later than lapse planned from has its deadline moved by the difference;
- `precondition` and `meets`: the same judgement as data the row store checks with the
  run's rows locked (no callable crosses into the edge): `meets(precondition(due, now),
  facts)` is `judge_facts(due, facts, now) is None` for the run's own namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, TypeAlias

from lapse.events.models import CleanupDue
from lapse.functions.reaping.stored import (
    EARLY_TOLERANCE,
    Backed,
    NotYet,
    StoredProof,
    Unbacked,
    prove,
)

__all__ = [
    "EARLY_TOLERANCE",
    "FINISH_TOLERANCE",
    "Contradiction",
    "Keep",
    "MoveTo",
    "NotOwned",
    "NotYet",
    "Precondition",
    "Proof",
    "Proven",
    "RunFacts",
    "Unbacked",
    "judge_facts",
    "meets",
    "precondition",
    "prove",
]

# Finish times are stored in whole seconds by KFP (FinishedAtInSec) and Argo's archive.
FINISH_TOLERANCE: Final = timedelta(seconds=1)

# The stored-schedule proof moved to functions/reaping/stored.py (shared with the
# artifact-reaper); these names stay importable from here.
Proven = Backed
Proof: TypeAlias = StoredProof


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the database says of a run, read inside the deleting transaction."""

    running: bool
    finished_at: datetime | None
    state: str | None = None
    # The namespace the table records for the run ("" when its column is NULL); None where
    # the table records none (or it was not read).
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class Keep:
    """The database says the run is not finished: its rows stay (re-planned when it ends)."""

    reason: str


@dataclass(frozen=True, slots=True)
class MoveTo:
    """The run finished later than lapse planned from: the deadline moves by as much."""

    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class NotOwned:
    """The database says the rows the key names are another namespace's run: `refused`."""

    reason: str


Contradiction: TypeAlias = NotOwned | Keep | MoveTo


def judge_facts(due: CleanupDue, facts: RunFacts, now: datetime) -> Contradiction | None:
    """None when the database agrees with the plan (delete); otherwise why not. Whose run
    it is comes first: another namespace's rows are never this run's, finished or not."""
    if facts.namespace is not None and facts.namespace != due.run.namespace:
        return NotOwned(
            f"the database records the rows {due.run.subject}'s key names as a run of "
            f"namespace {facts.namespace[:63]!r}, not {due.run.namespace!r}; nothing was deleted"
        )
    planned = due.run.finished_at
    if facts.running or facts.finished_at is None:
        state = f" ({facts.state})" if facts.state else ""
        return Keep(f"the database says {due.run.subject} is not finished{state}")
    if planned is None or facts.finished_at - planned <= FINISH_TOLERANCE:
        return None
    later = facts.finished_at - planned
    deadline = due.deadline + later
    if deadline - now <= EARLY_TOLERANCE:
        return None  # finished later, and due all the same
    return MoveTo(
        deadline,
        f"the database says {due.run.subject} finished at {facts.finished_at.isoformat()}, "
        f"{later.total_seconds():.0f}s after lapse planned from; due {deadline.isoformat()}",
    )


@dataclass(frozen=True, slots=True)
class Precondition:
    """What the database's own account of a run must say for its rows to be deleted, as
    data: the row store checks it (`meets`) on the run's parent rows, read locked in the
    deleting transaction. The run is finished (a finish time, a state that is not running),
    no later than `finished_by` (None: lapse planned from no finish time, any will do).
    Whose run it is (the namespace) the store holds apart, with or without a
    precondition (functions/row_reaper/ports.py: `RunRows.namespace`)."""

    finished_by: datetime | None


def precondition(due: CleanupDue, now: datetime) -> Precondition:
    """`judge_facts`'s agreement as a bound: a finish within `FINISH_TOLERANCE` of the
    planned one, or later by no more than leaves the moved deadline due at `now`."""
    planned = due.run.finished_at
    if planned is None:
        return Precondition(None)
    due_anyway = now + EARLY_TOLERANCE - due.deadline
    return Precondition(planned + max(FINISH_TOLERANCE, due_anyway))


def meets(precondition: Precondition, facts: RunFacts) -> bool:
    """Whether the database's account of the run (its namespace aside) lets its rows go."""
    if facts.running or facts.finished_at is None:
        return False
    return precondition.finished_by is None or facts.finished_at <= precondition.finished_by
