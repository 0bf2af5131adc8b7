"""`SqlRowStore`: the RowStore port on a SQLAlchemy async engine."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from lapse.edges.rows.delete import delete_target, normalizer
from lapse.edges.rows.failures import DATABASE_ERRORS, classify_failure, is_conflict
from lapse.edges.rows.guard import read_facts
from lapse.edges.rows.mlmd import delete_footprint, read_run
from lapse.edges.rows.model import BadKey, BoundTarget, PendingRun
from lapse.edges.rows.reflect import SchemaMismatch, reflect_targets
from lapse.errors import LapseError
from lapse.functions.row_reaper.mlmd import (
    DELETE_ORDER,
    ArtifactAccount,
    MlmdRun,
    artifact_account,
    facts,
    footprint,
)
from lapse.functions.row_reaper.ports import (
    Contradicted,
    Counted,
    Rejected,
    RunResult,
    RunRows,
    Unavailable,
)
from lapse.functions.row_reaper.targets import TargetSpec

DEFAULT_TIMEOUT: Final = 60.0
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
            run = PendingRun(index, rows.keys, rows.accepts, record=rows.record)
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
        tallies: list[dict[tuple[str, str], int]] = [{} for _ in runs]
        refused: dict[int, Contradicted] = {}
        async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
            normalize = normalizer(conn)
            async with conn.begin() as tx:
                # The preconditions first, every run's rows locked while they are judged:
                # a run the database contradicts keeps all its rows, in every target.
                graphs: dict[tuple[str, int], MlmdRun] = {}
                for target in self._bound or ():
                    if target.mlmd is not None:
                        await _read_graphs(conn, target, runs, graphs, refused, dry_run)
                        continue
                    members = [
                        i
                        for i, run in enumerate(runs)
                        if target.spec.name in run.keys and run.accepts is not None
                    ]
                    if target.guard is None or not members:
                        continue
                    facts_of = await read_facts(
                        conn,
                        target,
                        [runs[i] for i in members],
                        dry_run=dry_run,
                        normalize=normalize,
                    )
                    for position, fact in facts_of.items():
                        index = members[position]
                        accepts = runs[index].accepts
                        if accepts is not None and not accepts(fact):
                            refused.setdefault(index, Contradicted(fact))
                for target in self._bound or ():
                    members = [
                        i
                        for i, run in enumerate(runs)
                        if target.spec.name in run.keys and i not in refused
                    ]
                    if target.mlmd is not None:
                        together = [
                            g
                            for (name, i), g in graphs.items()
                            if name == target.spec.name and i in members
                        ]
                        for i in members:
                            graph = graphs.get((target.spec.name, i))
                            record = runs[i].record
                            if record is not None and not dry_run:
                                # Before the rows go: afterwards nothing says which URIs
                                # were the run's (a failure here commits nothing).
                                await record(
                                    artifact_account(graph, together)
                                    if graph is not None
                                    else ArtifactAccount(runs[i].keys[target.spec.name])
                                )
                            counts = (
                                await delete_footprint(
                                    conn, target.mlmd, footprint(graph, together)
                                )
                                if graph is not None
                                else [(name, 0) for name in DELETE_ORDER]
                            )
                            for table, rows in counts:
                                tallies[i][(target.spec.name, table)] = rows
                    elif members:
                        await delete_target(
                            conn,
                            target,
                            [runs[i] for i in members],
                            [tallies[i] for i in members],
                            dry_run=dry_run,
                            normalize=normalize,
                        )
                if dry_run:
                    await tx.rollback()
        return [
            refused.get(i) or Counted(tuple((t, table, n) for (t, table), n in tally.items()))
            for i, tally in enumerate(tallies)
        ]


async def _read_graphs(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    graphs: dict[tuple[str, int], MlmdRun],
    refused: dict[int, Contradicted],
    dry_run: bool,
) -> None:
    """Each run's ML Metadata graph, its context row locked, and MLMD's own account of the
    run judged: an execution still NEW or RUNNING keeps every row of the run."""
    assert target.mlmd is not None
    name = target.spec.name
    for index, run in enumerate(runs):
        key = run.keys.get(name)
        if key is None:
            continue
        graph = await read_run(conn, target.mlmd, key, lock=not dry_run)
        if graph is None:
            continue
        graphs[(name, index)] = graph
        fact = facts(graph)
        if run.accepts is not None and not run.accepts(fact):
            refused.setdefault(index, Contradicted(fact))


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
