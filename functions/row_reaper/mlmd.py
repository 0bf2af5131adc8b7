"""A KFP run's footprint in ML Metadata (MLMD): what to delete, what to keep (pure).

KFP v2 records each run in MLMD (kubeflow/pipelines backend/src/v2/metadata/client.go): a
context of type `system.PipelineRun` named by the run id, child (ParentContext) of the
pipeline's `system.Pipeline` context; every execution is put with both contexts, so each is
associated with both and each artifact it outputs is attributed to both. A cached task's
execution in a later run outputs the earlier run's artifact again: that artifact is then
attributed to the later run's context too.

So a run's footprint is its run context, the executions associated with it, their events,
and the artifacts its executions touched or its context holds — minus every artifact some
other run still uses (attributed to another `system.PipelineRun` context, or in an event of
an execution that is not the run's): those are kept (`shared`), as are their other rows.
The pipeline's context is shared by all its runs and is never deleted; only the rows tying
it to what is deleted go. MLMD has no foreign keys; `DELETE_ORDER` is its own dependency
order, children first (docs/architecture.md, "ML Metadata").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from lapse.functions.row_reaper.verdict import RunFacts

PIPELINE_RUN_CONTEXT_TYPE: Final = "system.PipelineRun"
CONTEXT_TYPE_KIND: Final = 2  # MLMD's Type.type_kind: 0 execution, 1 artifact, 2 context
# MLMD's Execution.State (metadata_store.proto): NEW = 1, RUNNING = 2 are not over.
UNFINISHED_EXECUTION_STATES: Final = {1: "NEW", 2: "RUNNING"}

# Children first: what points at an event, events, what points at an execution, artifact or
# context, then those. Names as MLMD's schema spells them (metadata_source schema v10).
DELETE_ORDER: Final = (
    "EventPath",
    "Event",
    "Association",
    "Attribution",
    "ParentContext",
    "ExecutionProperty",
    "Execution",
    "ArtifactProperty",
    "Artifact",
    "ContextProperty",
    "Context",
)


@dataclass(frozen=True, slots=True)
class MlmdExecution:
    id: int
    state: int | None
    last_update_ms: int
    # Other `system.PipelineRun` contexts it is associated with (none, in KFP).
    other_runs: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class MlmdArtifact:
    id: int
    uri: str | None
    # Other `system.PipelineRun` contexts it is attributed to (KFP caching).
    other_runs: frozenset[int] = frozenset()
    # Executions outside this run with an event on it (a later run read it).
    other_executions: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class MlmdRun:
    """What MLMD holds of one run, read with its context row locked."""

    run_id: str
    context_id: int
    context_last_update_ms: int
    executions: tuple[MlmdExecution, ...]
    artifacts: tuple[MlmdArtifact, ...]


@dataclass(frozen=True, slots=True)
class Footprint:
    """The ids to delete, and the artifacts kept because another run uses them."""

    context_id: int
    executions: tuple[int, ...]
    artifacts: tuple[int, ...]
    shared: tuple[int, ...]


def footprint(run: MlmdRun, together: Sequence[MlmdRun] = ()) -> Footprint:
    """What to delete of `run`; `together`: the other runs deleted in the same transaction,
    whose use of an artifact does not keep it (it is attributed only to runs being deleted)."""
    going = {r.context_id for r in together if r.context_id != run.context_id}
    executions = tuple(sorted(e.id for e in run.executions if not (e.other_runs - going)))
    leaving = set(executions) | {e.id for r in together for e in r.executions}
    artifacts: list[int] = []
    shared: list[int] = []
    for artifact in run.artifacts:
        used_elsewhere = (artifact.other_runs - going) or (artifact.other_executions - leaving)
        (shared if used_elsewhere else artifacts).append(artifact.id)
    return Footprint(run.context_id, executions, tuple(sorted(artifacts)), tuple(sorted(shared)))


def run_only_artifact_uris(run: MlmdRun, together: Sequence[MlmdRun] = ()) -> list[str]:
    """The URIs of the artifacts that belong to this run alone: what may be deleted from
    object storage with it. An artifact another run uses (KFP caching) is left out, and so
    is one without a URI."""
    only = set(footprint(run, together).artifacts)
    return sorted({a.uri for a in run.artifacts if a.id in only and a.uri})


@dataclass(frozen=True, slots=True)
class ArtifactAccount:
    """ML Metadata's account of a run's artifacts, taken in the transaction that deletes
    its MLMD rows (after it, nothing says which URIs were the run's): `run_only`, the URIs
    of the artifacts deleted with the run; `shared`, each URI another run still uses, with
    who uses it (`ML Metadata run context 8`, else `ML Metadata execution 99`)."""

    run_id: str
    run_only: tuple[str, ...] = ()
    shared: tuple[tuple[str, tuple[str, ...]], ...] = ()


def artifact_account(run: MlmdRun, together: Sequence[MlmdRun] = ()) -> ArtifactAccount:
    """What object storage should know of `run` before its MLMD rows go: the same split as
    `footprint` (runs in `together` go in the same transaction and keep nothing)."""
    plan = footprint(run, together)
    going = {r.context_id for r in together if r.context_id != run.context_id}
    leaving = set(plan.executions) | {e.id for r in together for e in r.executions}
    shared: dict[str, set[str]] = {}
    for artifact in run.artifacts:
        if artifact.id not in plan.shared or not artifact.uri:
            continue
        users = shared.setdefault(artifact.uri, set())
        # The runs that use it; an execution only where no run context says so (in KFP
        # every execution is associated with its run's context).
        runs = {f"ML Metadata run context {c}" for c in artifact.other_runs - going}
        users |= runs or {f"ML Metadata execution {e}" for e in artifact.other_executions - leaving}
    run_only = run_only_artifact_uris(run, together)
    return ArtifactAccount(
        run.run_id,
        tuple(uri for uri in run_only if uri not in shared),
        tuple((uri, tuple(sorted(users))) for uri, users in sorted(shared.items())),
    )


def facts(run: MlmdRun) -> RunFacts:
    """MLMD's account of the run: running while any of its executions is NEW or RUNNING;
    finished at its latest update (the context's or an execution's)."""
    unfinished = [
        f"execution {e.id} {UNFINISHED_EXECUTION_STATES[e.state]}"
        for e in run.executions
        if e.state in UNFINISHED_EXECUTION_STATES
    ]
    latest = max(
        [run.context_last_update_ms, *(e.last_update_ms for e in run.executions)], default=0
    )
    finished = datetime.fromtimestamp(latest / 1000, UTC) if latest > 0 else None
    state = ", ".join(unfinished[:3]) if unfinished else None
    return RunFacts(running=bool(unfinished), finished_at=finished, state=state)
