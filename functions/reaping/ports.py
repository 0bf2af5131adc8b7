"""What a target supplies to the reaping sequence (sequence.py): a small port, the same
five steps for Kubernetes objects, database rows and object-store artifacts, and for any
target added later.

- `prove(claim, trust)`: what the due event is believed to be about, from a source the
  tenant cannot write: the API server's identity of the object (its read, or the version
  lapse itself read and delivered `OBSERVED`), or the schedule lapse stored.
- `read(proof, again)`: what the judgement needs, read now (`again`: after a conflict).
- `judge(proof, found, now)`: pure: a `Removal` (what to remove, the precondition the
  store is to enforce) or an `End`.
- `remove(removal, part)`: remove one part, held to the precondition. Raises `Conflict` when
  the store refused because it changed (the sequence reads and judges again), `Gone`,
  `Unavailable` or `Refused` (failures.py), or ends (a row store's precondition, checked
  with the rows locked, says why not).
- `removed(removal, done)`: the end once every part is removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, Protocol, TypeVar

from lapse.events.models import CleanupDue
from lapse.events.run import Target
from lapse.functions.reaping.ends import End
from lapse.functions.trust import Provenance, Trust

W = TypeVar("W")
F = TypeVar("F")


@dataclass(frozen=True, slots=True)
class Proven:
    """The due event is about `due` (its run and deadline), as a source the tenant cannot
    write says. `provenance`: whether `due.run` is a version lapse read from the API server.
    `read`: whether the judgement must read first (False: that version may be judged
    as it is, the store holding the removal to it)."""

    due: CleanupDue
    provenance: Provenance
    read: bool = True


@dataclass(frozen=True, slots=True)
class Removal(Generic[W]):
    """What the judgement says to remove now: `what` (the target's: the version judged and
    its preconditions, a run's row keys, a batch of keys), in parts that the brake and the
    rate limit count (`parts`: units per part; an object or a run's rows is one part of
    one). `due`: what is put again if the brake holds it back."""

    due: CleanupDue
    what: W
    provenance: Provenance
    parts: Sequence[int] = field(default=(1,))


class TargetPort(Protocol[F, W]):
    @property
    def target(self) -> Target: ...

    @property
    def units(self) -> str:
        """What the brake counts, in the brake's alert: "deletions", "runs' rows", "objects"."""
        ...

    async def prove(self, claim: CleanupDue, trust: Trust) -> Proven | End: ...

    async def read(self, proof: Proven, *, again: bool) -> F: ...

    def judge(self, proof: Proven, found: F, now: datetime) -> Removal[W] | End: ...

    async def dry_run(self, removal: Removal[W]) -> End: ...

    async def remove(self, removal: Removal[W], part: int) -> End | None: ...

    async def removed(self, removal: Removal[W], done: int) -> End: ...
