"""ML Metadata's path through a transaction (docs/architecture.md, "ML Metadata"): which
runs KFP's record vouches for, their graphs read with the run context locked and judged,
then their footprints recorded and deleted. The decisions are functions/row_reaper/mlmd.py's;
the reads and deletes lapse/edges/rows/mlmd.py's."""

from __future__ import annotations

from lapse.edges.rows.batch import Batch
from lapse.edges.rows.mlmd import delete_footprint, read_run
from lapse.edges.rows.model import BoundTarget
from lapse.functions.row_reaper.mlmd import (
    DELETE_ORDER,
    ArtifactAccount,
    MlmdRun,
    artifact_account,
    facts,
    footprint,
)
from lapse.functions.row_reaper.verdict import meets


async def lock_and_judge_graphs(batch: Batch, target: BoundTarget, kfp: BoundTarget | None) -> None:
    """Each keyed run not refused yet: vouched for by KFP's locked record (`kfp`), else
    skipped with the reason; then its graph read, its context row locked, and MLMD's own
    account judged against the run's precondition (an execution still NEW or RUNNING
    keeps every row of the run, in every target)."""
    assert target.mlmd is not None
    name = target.spec.name
    vouched = batch.vouched.setdefault(name, [])
    for index in batch.keyed(target):
        if index in batch.refused:
            continue
        reason = _unvouched(batch, index, name, kfp)
        if reason is not None:
            batch.skipped[index][name] = reason
            continue
        vouched.append(index)
        graph = await read_run(
            batch.conn, target.mlmd, batch.runs[index].keys[name], lock=not batch.dry_run
        )
        if graph is not None:
            batch.graphs[(name, index)] = graph
            # MLMD's account spans the run's executions, read under the context's lock: it
            # is judged here, on what was read (`verdict.meets`), not in a WHERE.
            fact = facts(graph)
            precondition = batch.runs[index].precondition
            if precondition is not None and not meets(precondition, fact):
                batch.refuse(index, fact)


def _unvouched(batch: Batch, index: int, name: str, kfp: BoundTarget | None) -> str | None:
    """Why ML Metadata's rows of the run may not be deleted: MLMD holds nothing a tenant
    cannot write (KFP's pods write it), so its run id counts only where KFP's own record
    (run_details, locked in this transaction) names it a run of the run's namespace."""
    if kfp is None or kfp.parent.namespace is None:
        return (
            "not deleted: nothing but KFP's own record says whose run an ML Metadata "
            "run id is (enable database.targets.kfp)"
        )
    run = batch.runs[index]
    key = run.keys[name]
    if run.keys.get(kfp.spec.name) != key or index not in batch.owned.get(kfp.spec.name, ()):
        return (
            f"not deleted: KFP's database has no run {key[:64]!r} of namespace "
            f"{run.namespace!r} to vouch for it"
        )
    return None


async def delete_footprints(batch: Batch, target: BoundTarget) -> None:
    """The footprint of each vouched run still standing, recorded first (the run's
    `record`), then deleted and counted per MLMD table; runs deleted together do not keep
    each other's artifacts."""
    assert target.mlmd is not None
    name = target.spec.name
    members = batch.members(target)
    together = [g for (n, i), g in batch.graphs.items() if n == name and i in members]
    for index in members:
        graph = batch.graphs.get((name, index))
        await _record(batch, index, graph, together, name)
        counts = (
            await delete_footprint(batch.conn, target.mlmd, footprint(graph, together))
            if graph is not None
            else [(table, 0) for table in DELETE_ORDER]
        )
        for table, rows in counts:
            batch.tallies[index][(name, table)] = rows


async def _record(
    batch: Batch, index: int, graph: MlmdRun | None, together: list[MlmdRun], name: str
) -> None:
    """Before the rows go: afterwards nothing says which URIs were the run's (a failure
    here commits nothing). Never in a dry run."""
    run = batch.runs[index]
    if run.record is None or batch.dry_run:
        return
    await run.record(
        artifact_account(graph, together) if graph is not None else ArtifactAccount(run.keys[name])
    )
