"""ML Metadata's account of a KFP run's artifacts on its way into the run's capture (pure
parts): the split the row-reaper takes before the MLMD rows go
(functions/row_reaper/mlmd.py: `artifact_account`), the capture it lands in
(functions/artifact_reaper/capture.py: `with_metadata`, `carried`), and the reaper's use of
it (verdict.py: `shielded`, `awaits_metadata`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lapse.events.run import Engine, RunRef, Target
from lapse.functions.artifact_reaper.capture import (
    CapturedItem,
    KeptItem,
    RunCapture,
    carried,
    with_metadata,
)
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore
from lapse.functions.artifact_reaper.verdict import (
    METADATA_GRACE,
    GiveUp,
    NotRecorded,
    awaits_metadata,
    shielded,
)
from lapse.functions.ports import PendingSchedule
from lapse.functions.row_reaper.mlmd import (
    ArtifactAccount,
    MlmdArtifact,
    MlmdExecution,
    MlmdRun,
    artifact_account,
)
from lapse.functions.safety import GateRetry

NOW = datetime(2026, 1, 1, tzinfo=UTC)
COMPLETE = 3


def _config() -> ArtifactsConfig:
    store = ArtifactStore(name="kfp", url="s3://mlpipeline/v2/artifacts/", min_prefix_depth=4)
    return ArtifactsConfig(stores=(store,))


def test_the_account_splits_the_runs_own_uris_from_those_another_run_uses() -> None:
    run = MlmdRun(
        "a", 7, 0, (MlmdExecution(1, COMPLETE, 1),),
        (
            MlmdArtifact(10, "s3://b/a/log"),
            MlmdArtifact(11, "s3://b/a/model", other_runs=frozenset({8})),
            MlmdArtifact(12, "s3://b/a/stats", other_executions=frozenset({99})),
            MlmdArtifact(13, None, other_runs=frozenset({8})),
        ),
    )  # fmt: skip
    assert artifact_account(run) == ArtifactAccount(
        "a",
        ("s3://b/a/log",),
        (
            ("s3://b/a/model", ("ML Metadata run context 8",)),
            ("s3://b/a/stats", ("ML Metadata execution 99",)),
        ),
    )
    # Used by another run's context and executions: named by the run.
    both = MlmdArtifact(14, "s3://b/a/both", frozenset({8}), frozenset({99}))
    graph = MlmdRun("a", 7, 0, (), (both,))
    assert artifact_account(graph).shared == (("s3://b/a/both", ("ML Metadata run context 8",)),)
    # Deleted in one transaction with run 8, the model is nobody else's.
    other = MlmdRun("b", 8, 0, (MlmdExecution(2, COMPLETE, 1),), ())
    together = artifact_account(run, [run, other])
    assert together.run_only == ("s3://b/a/log", "s3://b/a/model")
    assert [uri for uri, _ in together.shared] == ["s3://b/a/stats"]


def test_the_account_lands_in_the_capture_by_store_and_outside_it_is_only_named() -> None:
    captured = RunCapture(uid="u-a")
    account = with_metadata(
        captured,
        [
            "minio://mlpipeline/v2/artifacts/demo/a/train/log",  # KFP's in-cluster MinIO
            "s3://mlpipeline/v2/artifacts/demo/a/eval/metrics/",  # a directory
            "s3://mlpipeline/elsewhere/demo/a/x",  # the bucket, not the root
            "gs://mlpipeline/v2/artifacts/demo/a/y",  # another provider
        ],
        [("s3://mlpipeline/v2/artifacts/demo/a/train/model", ["ML Metadata run context 8"])],
        _config(),
    )
    assert account.metadata is not None
    assert account.all_items == (
        CapturedItem(store="kfp", key="v2/artifacts/demo/a/train/log", tree=False),
        CapturedItem(store="kfp", key="v2/artifacts/demo/a/eval/metrics", tree=False),
    )
    assert account.metadata.outside == (
        "s3://mlpipeline/elsewhere/demo/a/x",
        "gs://mlpipeline/v2/artifacts/demo/a/y",
    )
    model = CapturedItem(store="kfp", key="v2/artifacts/demo/a/train/model", tree=False)
    assert account.kept == (KeptItem(item=model, by=("ML Metadata run context 8",)),)
    # Planned again (a re-list), the capture keeps the account; a new account replaces it.
    again = carried(account, RunCapture(uid="u-a"))
    assert again.metadata == account.metadata
    assert carried(account, with_metadata(again, [], [], _config())).kept == ()


def test_what_another_run_uses_shields_itself_and_what_is_under_it() -> None:
    model = CapturedItem(store="kfp", key="v2/artifacts/demo/a/model", tree=False)
    kept = (KeptItem(item=model, by=("x",)),)
    assert shielded("kfp", "v2/artifacts/demo/a/model", kept)
    assert shielded("kfp", "v2/artifacts/demo/a/model/saved.pb", kept)
    assert not shielded("kfp", "v2/artifacts/demo/a/model.1", kept)
    assert not shielded("other", "v2/artifacts/demo/a/model", kept)


def test_a_kfp_runs_artifacts_wait_for_the_account_until_just_after_the_database_clock() -> None:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="kubeflow", name="demo-abc", uid="u-a", phase="Succeeded",
        finished_at=NOW, kfp_run_id="a",
    )  # fmt: skip
    database = PendingSchedule(Target.DATABASE, "u-a", NOW + timedelta(minutes=5))
    captured = RunCapture(uid="u-a")
    retry = GateRetry(backoff=timedelta(seconds=10), max_wait=timedelta(hours=1))

    def wait(now: datetime, run: RunRef = run, captured: RunCapture = captured) -> object:
        return awaits_metadata(run, captured, database, now, retry)

    first = database.deadline + METADATA_GRACE
    assert wait(NOW) == NotRecorded(first)
    # Still no account past the grace (rows kept, or the row-reaper waiting out its
    # database): every backoff up to max_wait past the deadline, then loudly nothing.
    assert wait(first) == NotRecorded(first + retry.backoff)
    late = wait(database.deadline + retry.max_wait)
    assert isinstance(late, GiveUp) and "nothing was deleted" in late.reason
    # Without a database schedule, once recorded, or not KFP's: no wait.
    assert awaits_metadata(run, captured, None, NOW, retry) is None
    assert wait(NOW, captured=with_metadata(captured, [], [], _config())) is None
    assert wait(NOW, run=run.model_copy(update={"kfp_run_id": None})) is None
