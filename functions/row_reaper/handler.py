"""The row-reaper: `cleanup.due` (target database) in, one outcome event out, by the one
reaping sequence (functions/reaping/sequence.py) with the rows' port below.

The row-reaper cannot read the run object (it is usually gone by the time its rows are
due), so it believes no due event's word for the deadline or the run: it reads what lapse
stored and what the database itself says (docs/architecture.md, "How a deletion is made
safe"; docs/security.md). The port's steps:

- **prove**: the schedule lapse stored for this (database, uid) - the due message the
  server fired from it, or the one still pending - says which run and which deadline
  (`verdict.prove`). Nothing stored: `refused`. A later stored deadline: `rescheduled`
  (the stored schedule will fire). The sequence then applies `safety.namespaces` to the
  stored run's namespace (`skipped`).
- **read**: the stored run's key per target; a target the run has no key for is skipped.
- **judge**: keys: remove the run's rows (`RunRows`), else `already_gone`.
- **remove**: one run's rows in one transaction, held to a precondition the database edge
  judges with the run's rows locked (`verdict.judge_facts`): where the database records
  whose run the rows are (KFP's run_details.Namespace, Argo's archive, a declared
  `namespace_column`), it names the namespace lapse stored with the run, else `refused`
  and nothing deleted (the key may be a tenant's label); ML Metadata only for a run id
  KFP's record vouched for in the same transaction. The database's own record says the
  run finished, no later than lapse planned from. Running: `kept`. Finished later:
  `rescheduled` by as much. Zero rows: `already_gone`.

The database being unreachable (or asking to back off) raises `Unavailable` (a
`RetryLater`): nothing was committed, the runtime delivers the event again.

Batching is the row store's (lapse/edges/rows/coalesce.py): the deletes of runs handled
concurrently go into one transaction, never two runs naming the same uid or row key in one
(functions/row_reaper/batches.py). `handle_batch` only handles a fetch's events side by
side.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Final, assert_never

from cloudevents.core.base import BaseCloudEvent

from lapse.events.models import CleanupDue, clip
from lapse.events.run import Target
from lapse.events.types import Outcome
from lapse.functions.reaping import failures
from lapse.functions.reaping.ends import End, Ended, Later
from lapse.functions.reaping.ports import Proven, Removal
from lapse.functions.reaping.sequence import Reaper
from lapse.functions.row_reaper import verdict
from lapse.functions.row_reaper.ports import (
    Contradicted,
    Counted,
    MetadataRecorder,
    Rejected,
    RowStore,
    RunResult,
    RunRows,
    Unavailable,
)
from lapse.functions.row_reaper.targets import ML_METADATA, RunKeys, keys_for
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/row-reaper"
STAGE: Final = "row-reaper"
# The first wait for a database that does not answer; the runtime's back-off takes it from
# there (lapse/runtime/outages.py: doubling to 60 s).
RETRY_DELAY: Final = 1.0


@dataclass(frozen=True)
class RowsPort:
    """The rows' port (functions/reaping/ports.py: `TargetPort`): what lapse stored proves
    the run, its keys are read from it, the database edge deletes them held to the run's
    precondition."""

    reaper: RowReaper

    @property
    def target(self) -> Target:
        return Target.DATABASE

    @property
    def units(self) -> str:
        return "runs' rows"

    async def prove(self, claim: CleanupDue, trust: Trust) -> Proven | End:
        # `trust` changes nothing: the rows are proved from what lapse stored, whoever
        # delivered the event.
        stored = await self.reaper.schedules.get(Target.DATABASE, claim.run.uid)
        proof = verdict.prove(claim, stored, self.reaper.clock())
        match proof:
            case verdict.Unbacked(reason=reason):
                detail = f"{reason}; nothing was deleted"
                return Ended(claim.run, Outcome.REFUSED, claim.deadline, detail)
            case verdict.NotYet(reason=reason):
                return Ended(claim.run, Outcome.RESCHEDULED, claim.deadline, reason)
            case verdict.Proven(due=due):
                return Proven(due, Provenance.CLAIMED)
        assert_never(proof)

    async def read(self, proof: Proven, *, again: bool) -> RunKeys:
        return keys_for(proof.due.run, self.reaper.rows.targets)

    def judge(self, proof: Proven, found: RunKeys, now: datetime) -> Removal[RunRows] | End:
        due = proof.due
        if not found.keys:
            return self._counted(due, Counted(()))
        return Removal(due, self._run_rows(due, found, now), Provenance.CLAIMED)

    async def dry_run(self, removal: Removal[RunRows]) -> End:
        return await self._delete(removal, dry_run=True)

    async def remove(self, removal: Removal[RunRows], part: int) -> End:
        return await self._delete(removal, dry_run=False)

    async def removed(self, removal: Removal[RunRows], done: int) -> End:
        raise AssertionError("remove ends every removal of rows")  # one part, always ended

    def _run_rows(self, due: CleanupDue, keys: RunKeys, now: datetime) -> RunRows:
        """The run's keys and its precondition, as data the store checks with the rows
        locked: the namespace lapse stored, and the database's account of the run agreeing
        with the plan (`verdict.precondition`, `verdict.judge_facts` as a bound)."""
        metadata = self.reaper.metadata
        record = None
        if metadata is not None and ML_METADATA in keys.keys:
            record = functools.partial(metadata.record, due.run.uid)
        return RunRows(
            keys.keys,
            verdict.precondition(due, now),
            record=record,
            namespace=due.run.namespace,
            uids=(due.run.uid,),
        )

    async def _delete(self, removal: Removal[RunRows], *, dry_run: bool) -> End:
        [result] = await self.reaper.rows.delete([removal.what], dry_run=dry_run)
        return self._ended(removal.due, result)

    def _ended(self, due: CleanupDue, result: RunResult) -> End:
        match result:
            case Counted():
                return self._counted(due, result)
            case Unavailable(reason=reason):
                raise failures.Unavailable(reason, RETRY_DELAY)
            case Rejected(reason=reason):
                raise failures.Refused(reason)
            case Contradicted(facts=facts):
                match verdict.judge_facts(due, facts, self.reaper.clock()):
                    case verdict.NotOwned(reason=reason):
                        return Ended(due.run, Outcome.REFUSED, due.deadline, reason)
                    case verdict.Keep(reason=reason):
                        return Ended(due.run, Outcome.KEPT, due.deadline, reason)
                    case verdict.MoveTo(deadline=deadline, reason=reason):
                        moved = due.model_copy(update={"deadline": deadline})
                        return Later(
                            moved, deadline, reason, Provenance.CLAIMED, reported=due.deadline
                        )
                    case None:
                        # Agreed on a second look (time passed): read and judge again.
                        raise failures.Conflict("the database's account of the run changed")
        assert_never(result)

    def _counted(self, due: CleanupDue, counted: Counted) -> Ended:
        dry_run = self.reaper.dry_run
        if dry_run:
            outcome = Outcome.DRY_RUN
        elif counted.total > 0:
            outcome = Outcome.DELETED
        else:
            outcome = Outcome.ALREADY_GONE
        skipped = keys_for(due.run, self.reaper.rows.targets).skipped
        detail = describe(counted, skipped, dry_run=dry_run)
        return Ended(due.run, outcome, due.deadline, detail, dry_run=dry_run)


@dataclass(frozen=True, kw_only=True)
class RowReaper(Reaper):
    """Constructed once per process (`Reaper`: the limits, shared or this process's own).
    `rows`: the database edge; give it the coalescing front (lapse/edges/rows) for the
    deletes of concurrent events to share transactions."""

    SOURCE: ClassVar[str] = SOURCE
    STAGE: ClassVar[str] = STAGE
    TARGET: ClassVar[Target] = Target.DATABASE

    rows: RowStore
    # Where ML Metadata's account of a run's artifacts goes before its MLMD rows are
    # deleted (the artifacts target's capture), when both targets are configured.
    metadata: MetadataRecorder | None = field(default=None, repr=False, compare=False)

    def port(self) -> RowsPort:
        return RowsPort(self)

    async def handle_batch(
        self, events: Sequence[tuple[BaseCloudEvent, Trust]]
    ) -> list[list[BaseCloudEvent] | Exception]:
        """Each event handled side by side (`lapse up`'s dispatcher hands it each fetch):
        one entry per event, in order - the events emitted for it, else what `handle`
        raised for it (`RetryLater`, or a bug). One event's failure is never another's."""
        answers = await asyncio.gather(
            *(self.handle(event, trust) for event, trust in events), return_exceptions=True
        )
        results: list[list[BaseCloudEvent] | Exception] = []
        for answer in answers:
            if isinstance(answer, Exception) or not isinstance(answer, BaseException):
                results.append(answer)
            else:
                raise answer  # cancelled, interrupted: not an event's answer
        return results


def describe(counted: Counted, skipped: Mapping[str, str], *, dry_run: bool = False) -> str:
    """`kfp: run_metrics=3, tasks=2, ...; argo_archive: skipped (why)` (bounded)."""
    per_target: dict[str, list[str]] = {}
    for target, table, rows in counted.counts:
        per_target.setdefault(target, []).append(f"{table}={rows}")
    parts = [f"{target}: {', '.join(tables)}" for target, tables in per_target.items()]
    if parts and dry_run:
        parts[0] = f"would delete {parts[0]}"
    skips = [*skipped.items(), *counted.skipped]
    parts += [f"{target}: skipped ({reason})" for target, reason in skips]
    return clip("; ".join(parts))
