"""Where the reaping sequence ends: one of four values, concluded into the due event's
outcome events in one place (`sequence.conclude`).

- `Ended`: a `cleanup.completed` with this outcome, and nothing more to do (deleted,
  already_gone, replaced, kept, skipped, refused, dry_run, and rescheduled when the
  schedule lapse stored will fire anyway).
- `Failed`: a `cleanup.failed`: nothing deleted, and retrying will not change it.
- `Later`: not now: `due` is put again, delivered at `fire_at`; `rescheduled`.
- `Held`: the mass-deletion brake held it back until `until`; `rescheduled`, and the
  brake's alert when this admission tripped it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

from lapse.events.models import CleanupDue
from lapse.events.run import RunRef
from lapse.events.types import Outcome
from lapse.functions.trust import Provenance


@dataclass(frozen=True, slots=True)
class Ended:
    run: RunRef
    outcome: Outcome
    deadline: datetime
    detail: str
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    run: RunRef
    reason: str


@dataclass(frozen=True, slots=True)
class Later:
    """`due` (its run, deadline and policy) is put again, to fire at `fire_at`; the outcome
    reports `reported` as the deadline. `provenance`: whether `due.run` is a version lapse
    read from the API server."""

    due: CleanupDue
    fire_at: datetime
    reason: str
    provenance: Provenance
    reported: datetime | None = None  # None: due.deadline


@dataclass(frozen=True, slots=True)
class Held:
    """The brake is engaged: `due` is put again for `until`; `tripped` when this admission
    engaged it (then the alert goes out once); `done` units were removed before it held."""

    due: CleanupDue
    until: datetime
    tripped: bool
    provenance: Provenance
    done: int = 0


End: TypeAlias = Ended | Failed | Later | Held
