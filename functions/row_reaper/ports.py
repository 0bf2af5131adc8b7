"""What the row-reaper needs from the database, as a Protocol (the edge is `lapse.edges.rows`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from lapse.functions.row_reaper.mlmd import ArtifactAccount
from lapse.functions.row_reaper.targets import TargetSpec
from lapse.functions.row_reaper.verdict import Precondition, RunFacts


@dataclass(frozen=True)
class Counted:
    """Rows deleted (or, in a dry run, that would be) per (target, table), in delete order."""

    counts: tuple[tuple[str, str, int], ...]
    # Targets the store did not touch for this run, and why (ML Metadata of a run KFP's
    # own record did not vouch for in the transaction).
    skipped: tuple[tuple[str, str], ...] = ()

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


@dataclass(frozen=True)
class Contradicted:
    """The database's own account of the run (`facts`) failed the run's precondition:
    nothing of it was deleted."""

    facts: RunFacts


RunResult: TypeAlias = Counted | Rejected | Unavailable | Contradicted


@dataclass(frozen=True)
class RunRows:
    """One run's rows to delete: its key per target name, and the precondition the
    database's account of the run must meet (`verdict.Precondition`, data the store checks
    with the run's rows locked in the deleting transaction; None: no precondition). A
    target that keeps no such account, or a run it has no row for, is not checked."""

    keys: Mapping[str, str]
    precondition: Precondition | None = None
    # The run's namespace as lapse stored it (from the API server's object). A target whose
    # parent table records a namespace deletes the run's rows only when its parent row is
    # there and names this one (None: never), whatever the precondition; a row of another
    # namespace makes the run `Contradicted` (functions/row_reaper/targets.py: Step).
    namespace: str | None = None
    # Called with ML Metadata's account of the run's artifacts inside the deleting
    # transaction, before its MLMD rows are deleted and before it commits (never in a dry
    # run; an empty account when MLMD has no such run). What it raises is raised by
    # `delete`, and nothing is committed: the account is never lost with the rows.
    record: Callable[[ArtifactAccount], Awaitable[None]] | None = None
    # The run uids these rows were proved for (lapse's stored run): a store that puts
    # several runs in one transaction keeps two runs naming one uid apart
    # (functions/row_reaper/batches.py).
    uids: tuple[str, ...] = ()


class MetadataRecorder(Protocol):
    """Where ML Metadata's account of a run's artifacts goes before its rows are deleted
    (the run's artifact capture: functions/artifact_reaper/metadata.py). Raise
    `RetryLater` when it cannot be recorded now."""

    async def record(self, uid: str, account: ArtifactAccount) -> None: ...


class RowStore(Protocol):
    @property
    def targets(self) -> Sequence[TargetSpec]:
        """The targets this store was validated against at start-up."""
        ...

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        """Delete the rows of every run and report one result per run.

        Many runs go into one transaction (the row-reaper hands one run per call; the
        edge's coalescing front gathers concurrent calls); a run's rows are either all deleted and
        committed (`Counted`) or none are; a run whose precondition fails keeps them all
        (`Contradicted`). With `dry_run` nothing is deleted and the counts say what would
        have been. Database trouble is reported, never raised.
        """
        ...
