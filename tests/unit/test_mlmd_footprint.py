"""The pure decision on a KFP run's ML Metadata (functions/row_reaper/mlmd.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from lapse.functions.row_reaper.mlmd import (
    MlmdArtifact,
    MlmdExecution,
    MlmdRun,
    facts,
    footprint,
    run_only_artifact_uris,
)

COMPLETE, RUNNING, CACHED = 3, 2, 5


def run(*executions: MlmdExecution, artifacts: tuple[MlmdArtifact, ...] = ()) -> MlmdRun:
    return MlmdRun("r1", 7, 1_700_000_000_000, executions, artifacts)


def test_artifacts_another_run_uses_are_kept_and_left_out_of_the_uris() -> None:
    graph = run(
        MlmdExecution(1, COMPLETE, 1_700_000_600_000),
        MlmdExecution(2, COMPLETE, 1_700_000_650_000),
        artifacts=(
            MlmdArtifact(10, "s3://b/r1/own"),
            MlmdArtifact(11, "s3://b/r1/cached", other_runs=frozenset({8})),  # KFP caching
            MlmdArtifact(12, "s3://b/r1/read", other_executions=frozenset({99})),
            MlmdArtifact(13, "s3://b/r1/read-here", other_executions=frozenset({2})),
            MlmdArtifact(14, None),
        ),
    )
    plan = footprint(graph)
    assert plan.executions == (1, 2)
    assert plan.artifacts == (10, 13, 14) and plan.shared == (11, 12)
    assert run_only_artifact_uris(graph) == ["s3://b/r1/own", "s3://b/r1/read-here"]


def test_an_execution_of_another_run_too_is_kept() -> None:
    plan = footprint(run(MlmdExecution(1, COMPLETE, 1, other_runs=frozenset({8}))))
    assert plan.executions == ()


def test_running_while_an_execution_is_new_or_running_finished_at_the_latest_update() -> None:
    done = facts(run(MlmdExecution(1, COMPLETE, 1_700_000_600_000), MlmdExecution(2, CACHED, 0)))
    assert not done.running
    assert done.finished_at == datetime.fromtimestamp(1_700_000_600, UTC)
    going = facts(run(MlmdExecution(1, COMPLETE, 5), MlmdExecution(2, RUNNING, 6)))
    assert going.running and going.state == "execution 2 RUNNING"


def test_runs_deleted_together_do_not_keep_each_others_artifacts() -> None:
    """A cached artifact shared by two runs deleted in one transaction goes with them."""
    a = MlmdRun(
        "a", 7, 0, (MlmdExecution(1, COMPLETE, 1),),
        (MlmdArtifact(10, "s3://b/a/model", other_runs=frozenset({8}),
                      other_executions=frozenset({2})),),
    )  # fmt: skip
    b = MlmdRun(
        "b", 8, 0, (MlmdExecution(2, CACHED, 1),),
        (MlmdArtifact(10, "s3://b/a/model", other_runs=frozenset({7}),
                      other_executions=frozenset({1})),),
    )  # fmt: skip
    assert footprint(a).shared == (10,)
    assert footprint(a, [a, b]).artifacts == (10,) and footprint(b, [a, b]).artifacts == (10,)
