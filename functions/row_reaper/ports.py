"""What the row-reaper needs from the database, as a Protocol (the edge is `lapse.edges.rows`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from functions.row_reaper.targets import TargetSpec


@dataclass(frozen=True)
class Counted:
    """Rows deleted (or, in a dry run, that would be) per (target, table), in delete order."""

    counts: tuple[tuple[str, str, int], ...]

    @property
    def total(self) -> int:
        return sum(rows for _, _, rows in self.counts)


@dataclass(frozen=True)
class Rejected:
    """The database refused this run for a reason that retrying will not change
    (a key that does not fit the column's type, a foreign key from an undeclared table)."""

    reason: str


@dataclass(frozen=True)
class Unavailable:
    """Nothing was committed for this run: the database could not be reached or asked us to
    come back (deadlock, lock timeout, shutdown)."""

    reason: str


RunResult: TypeAlias = Counted | Rejected | Unavailable


class RowStore(Protocol):
    @property
    def targets(self) -> Sequence[TargetSpec]:
        """The targets this store was validated against at start-up."""
        ...

    async def delete(self, runs: Sequence[Mapping[str, str]], *, dry_run: bool) -> list[RunResult]:
        """Delete the rows of every run (`{target name: key}`) and report one result per run.

        Many runs go into one transaction; a run's rows are either all deleted and
        committed (`Counted`) or none are. With `dry_run` nothing is deleted and the counts
        say what would have been. Database trouble is reported, never raised.
        """
        ...
