"""`SqlRowStore`: the RowStore port on a SQLAlchemy async engine."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from lapse.config.schema import DATABASE_STATEMENT_TIMEOUT
from lapse.edges.rows.delete import Normalize, delete_target, normalizer
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
                index, rows.keys, rows.accepts, record=rows.record, namespace=rows.namespace
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
        tallies: list[dict[tuple[str, str], int]] = [{} for _ in runs]
        refused: dict[int, Contradicted] = {}
        skipped: list[dict[str, str]] = [{} for _ in runs]
        async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
            normalize = normalizer(conn)
            async with conn.begin() as tx:
                # The preconditions first, every run's rows locked while they are judged:
                # a run the database contradicts keeps all its rows, in every target.
                owned = await self._judge(conn, runs, refused, dry_run, normalize)
                graphs: dict[tuple[str, int], MlmdRun] = {}
                vouched: dict[str, list[int]] = {}
                for target in self._bound or ():
                    if target.mlmd is None:
                        continue
                    name = target.spec.name
                    vouched[name] = []
                    for i, run in enumerate(runs):
                        if name not in run.keys or i in refused:
                            continue
                        reason = self._unvouched(i, run, name, owned)
                        if reason is None:
                            vouched[name].append(i)
                        else:
                            skipped[i][name] = reason
                    await _read_graphs(conn, target, runs, vouched[name], graphs, refused, dry_run)
                for target in self._bound or ():
                    name = target.spec.name
                    members = [i for i, run in enumerate(runs) if name in run.keys]
                    if target.mlmd is not None:
                        members = vouched[name]
                    elif target.parent.namespace is not None:
                        # Only runs whose parent row names their namespace (locked above):
                        # without that row nothing says whose the other tables' rows are.
                        for i in members:
                            tallies[i] |= {(name, step.name): 0 for step in target.steps}
                        members = [i for i in members if i in owned.get(name, ())]
                    members = [i for i in members if i not in refused]
                    if target.mlmd is not None:
                        together = [g for (n, i), g in graphs.items() if n == name and i in members]
                        for i in members:
                            graph = graphs.get((name, i))
                            record = runs[i].record
                            if record is not None and not dry_run:
                                # Before the rows go: afterwards nothing says which URIs
                                # were the run's (a failure here commits nothing).
                                await record(
                                    artifact_account(graph, together)
                                    if graph is not None
                                    else ArtifactAccount(runs[i].keys[name])
                                )
                            counts = (
                                await delete_footprint(
                                    conn, target.mlmd, footprint(graph, together)
                                )
                                if graph is not None
                                else [(table, 0) for table in DELETE_ORDER]
                            )
                            for table, rows in counts:
                                tallies[i][(name, table)] = rows
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
            refused.get(i)
            or Counted(
                tuple((t, table, n) for (t, table), n in tally.items()),
                tuple(skipped[i].items()),
            )
            for i, tally in enumerate(tallies)
        ]

    async def _judge(
        self,
        conn: AsyncConnection,
        runs: list[PendingRun],
        refused: dict[int, Contradicted],
        dry_run: bool,
        normalize: Normalize,
    ) -> dict[str, set[int]]:
        """Each target's account of each run, its parent rows locked: a row of another
        namespace (whatever the run's precondition) or a failed precondition refuses the
        run. Returns, per target that records namespaces, the runs whose parent row names
        theirs."""
        owned: dict[str, set[int]] = {}
        for target in self._bound or ():
            if target.mlmd is not None:
                continue
            checks_owner = target.parent.namespace is not None
            members = [
                i
                for i, run in enumerate(runs)
                if target.spec.name in run.keys and (checks_owner or run.accepts is not None)
            ]
            if (target.guard is None and not checks_owner) or not members:
                continue
            facts_of = await read_facts(
                conn, target, [runs[i] for i in members], dry_run=dry_run, normalize=normalize
            )
            for position, fact in facts_of.items():
                index = members[position]
                accepts = runs[index].accepts
                foreign = checks_owner and fact.namespace != runs[index].namespace
                judged = target.guard is not None and accepts is not None
                if foreign or (judged and accepts is not None and not accepts(fact)):
                    refused.setdefault(index, Contradicted(fact))
                elif checks_owner:
                    owned.setdefault(target.spec.name, set()).add(index)
        return owned

    def _unvouched(
        self, position: int, run: PendingRun, name: str, owned: dict[str, set[int]]
    ) -> str | None:
        """Why ML Metadata's rows of `run` may not be deleted: MLMD holds nothing a tenant
        cannot write (KFP's pods write it), so its run id counts only where KFP's own
        record (run_details, in this transaction) names it a run of the run's namespace."""
        kfp = next((b for b in self._bound or () if b.spec.name == KFP), None)
        if kfp is None or kfp.parent.namespace is None:
            return (
                "not deleted: nothing but KFP's own record says whose run an ML Metadata "
                "run id is (enable database.targets.kfp)"
            )
        key = run.keys[name]
        if run.keys.get(KFP) != key or position not in owned.get(KFP, ()):
            return (
                f"not deleted: KFP's database has no run {key[:64]!r} of namespace "
                f"{run.namespace!r} to vouch for it"
            )
        return None


async def _read_graphs(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    members: list[int],
    graphs: dict[tuple[str, int], MlmdRun],
    refused: dict[int, Contradicted],
    dry_run: bool,
) -> None:
    """Each member run's ML Metadata graph, its context row locked, and MLMD's own account
    of the run judged: an execution still NEW or RUNNING keeps every row of the run."""
    assert target.mlmd is not None
    name = target.spec.name
    for index in members:
        run = runs[index]
        graph = await read_run(conn, target.mlmd, run.keys[name], lock=not dry_run)
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
