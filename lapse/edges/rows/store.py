"""`SqlRowStore`: the RowStore port on a SQLAlchemy async engine."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config.schema import DATABASE_STATEMENT_TIMEOUT
from lapse.edges.rows.batch import Batch
from lapse.edges.rows.delete import delete_target, normalizer
from lapse.edges.rows.failures import DATABASE_ERRORS, classify_failure, is_conflict
from lapse.edges.rows.footprints import delete_footprints, lock_and_judge_graphs
from lapse.edges.rows.guard import lock_and_judge
from lapse.edges.rows.mlmd import read_run
from lapse.edges.rows.model import BadKey, BoundTarget, PendingRun
from lapse.edges.rows.reflect import SchemaMismatch, reflect_targets
from lapse.errors import LapseError
from lapse.functions.row_reaper.mlmd import MlmdRun
from lapse.functions.row_reaper.ports import Rejected, RunResult, RunRows, Unavailable
from lapse.functions.row_reaper.targets import KFP, TargetSpec

# lapse.yaml's database.statement_timeout: how long one call (a read, or one batch's
# transaction) may take before the database counts as unreachable for this try.
DEFAULT_TIMEOUT: Final = DATABASE_STATEMENT_TIMEOUT.total_seconds()
# Deadlocks between overlapping batches are retried in place this many times.
CONFLICT_RETRIES: Final = 5


class DatabaseUnavailable(LapseError):
    """The database could not be reached to check the schema."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SqlRowStore:
    """`lapse.functions.row_reaper.ports.RowStore` on a SQLAlchemy async engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        targets: Sequence[TargetSpec],
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.timeout = timeout
        self._targets = tuple(targets)
        self._bound: tuple[BoundTarget, ...] | None = None
        self._starting = asyncio.Lock()

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return self._targets

    @property
    def schemas(self) -> dict[str, str]:
        """Per target, the schema the database turned out to have where lapse tells
        versions apart (KFP: 2.17 or main); empty before `start`."""
        return {b.spec.name: b.schema for b in self._bound or () if b.schema is not None}

    async def mlmd_graph(self, run_id: str) -> MlmdRun | None:
        """What ML Metadata holds of one KFP run, read without locks (None: no
        `ml_metadata` target, or no such run). With functions/row_reaper/mlmd.py's
        `run_only_artifact_uris` it says which artifact URIs are the run's alone."""
        await self.start()
        target = next((b for b in self._bound or () if b.mlmd is not None), None)
        if target is None or target.mlmd is None:
            return None
        async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
            return await read_run(conn, target.mlmd, run_id, lock=False)

    async def start(self) -> None:
        """Reflect and check the schema: `SchemaMismatch` or `DatabaseUnavailable`."""
        async with self._starting:
            if self._bound is not None:
                return
            try:
                async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
                    bound = await conn.run_sync(reflect_targets, self._targets)
            except DATABASE_ERRORS as exc:
                raise DatabaseUnavailable(classify_failure(exc).reason) from exc
            self._bound = bound

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        try:
            await self.start()
        except DatabaseUnavailable as exc:
            return [Unavailable(exc.reason)] * len(runs)
        results: list[RunResult] = [Unavailable("not attempted")] * len(runs)
        prepared: list[PendingRun] = []
        for index, rows in enumerate(runs):
            run = PendingRun(
                index,
                rows.keys,
                rows.precondition,
                record=rows.record,
                namespace=rows.namespace,
            )
            try:
                self._coerce(run)
            except BadKey as exc:
                results[index] = Rejected(str(exc))
                continue
            prepared.append(run)
        for run, result in zip(prepared, await self._attempt(prepared, dry_run), strict=True):
            results[run.index] = result
        return results

    def _coerce(self, run: PendingRun) -> None:
        for target in self._bound or ():
            key = run.keys.get(target.spec.name)
            if key is None:
                continue
            for step in target.steps:
                if step.via is None:
                    try:
                        run.values[step] = step.coerce(key)
                    except ValueError as exc:
                        raise BadKey(
                            f"{target.spec.config_key}: key {key[:200]!r} does not fit "
                            f"column {step.table.fullname}.{step.column.name} ({exc})"
                        ) from None

    async def _attempt(self, runs: list[PendingRun], dry_run: bool) -> list[RunResult]:
        if not runs:
            return []
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                return await self._transaction(runs, dry_run)
            except DATABASE_ERRORS as exc:
                failure = classify_failure(exc)
                # A deadlock victim is rolled back and meant to be run again; InnoDB's gap
                # locks make that likely when batches overlap, so a few quick, jittered
                # tries cost less than the runtime's redelivery.
                if attempt < CONFLICT_RETRIES and is_conflict(exc):
                    await asyncio.sleep(random.uniform(0, 0.05 * (attempt + 1)))
                    continue
                break
        if isinstance(failure, Unavailable) or len(runs) == 1:
            return [failure] * len(runs)
        # Something in this batch is refused for good: find which run, commit the others.
        results: list[RunResult] = []
        for run in runs:
            if results and isinstance(results[-1], Unavailable):
                results.append(results[-1])
            else:
                results += await self._attempt([run], dry_run)
        return results

    async def _transaction(self, runs: list[PendingRun], dry_run: bool) -> list[RunResult]:
        """One transaction for `runs`: the rows that meet their run's precondition locked
        (the locking read's WHERE), then what stands deleted (rolled back in a dry run)."""
        async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
            batch = Batch(conn, runs, dry_run, normalizer(conn))
            async with conn.begin() as tx:
                await self._lock_and_judge(batch)
                await self._delete_standing(batch)
                if dry_run:
                    await tx.rollback()
        return batch.results()

    async def _lock_and_judge(self, batch: Batch) -> None:
        """The preconditions first, held by the database where a run's rows are locked: a
        run the database contradicts keeps all its rows, in every target. ML Metadata
        last: KFP's locked record vouches for its run ids."""
        bound = self._bound or ()
        for target in bound:
            if target.mlmd is None:
                await lock_and_judge(batch, target)
        kfp = next((b for b in bound if b.spec.name == KFP), None)
        for target in bound:
            if target.mlmd is not None:
                await lock_and_judge_graphs(batch, target, kfp)

    async def _delete_standing(self, batch: Batch) -> None:
        """Each target's rows of the runs still standing, counted per run."""
        for target in self._bound or ():
            if target.mlmd is not None:
                await delete_footprints(batch, target)
            elif members := batch.members(target):
                await delete_target(
                    batch.conn,
                    target,
                    [batch.runs[i] for i in members],
                    [batch.tallies[i] for i in members],
                    dry_run=batch.dry_run,
                    normalize=batch.normalize,
                )


async def open_row_store(
    engine: AsyncEngine, targets: Sequence[TargetSpec], *, timeout: float = DEFAULT_TIMEOUT
) -> SqlRowStore:
    """The row store for `targets`, its schema checked now.

    Raises `SchemaMismatch` (a configuration problem: exit, do not retry) or
    `DatabaseUnavailable` (the runtime may start anyway: every delete then retries the
    check and reports `Unavailable` until the database answers).
    """
    if not targets:
        raise SchemaMismatch(
            [
                "database.targets: nothing to delete "
                "(enable kfp, argo_archive, ml_metadata or tekton_results, or declare tables)"
            ]
        )
    store = SqlRowStore(engine, targets, timeout=timeout)
    await store.start()
    return store
