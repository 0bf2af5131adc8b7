"""The artifacts target's pure parts: the reaper's judgement of captured items
(functions/artifact_reaper/verdict.py), what a run captures (capture.py, the Argo reader
in events/adapters/argo_artifacts.py), the stores' configuration and the artifacts clock
(functions/policy.py). Properties over generated keys, paths and stores: nothing judged
deletable is outside its store's root or shallower than its depth, and nothing listed
beside an item belongs to it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lapse.events.adapters.argo_artifacts import argo_artifacts
from lapse.events.artifacts import RunArtifacts, StoredArtifact
from lapse.events.kinds import DEFAULT_KINDS
from lapse.events.run import Engine, RunRef, Target
from lapse.functions.artifact_reaper.capture import CapturedItem, capture, render
from lapse.functions.artifact_reaper.ports import StoredObject
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore
from lapse.functions.artifact_reaper.verdict import (
    Allowed,
    Disallowed,
    Shared,
    belongs,
    changed,
    depth,
    judge,
)
from lapse.functions.policy import Action, Policy, decide

FINISHED = datetime(2026, 1, 1, tzinfo=UTC)


def _run(**update: object) -> RunRef:
    run = RunRef(
        engine=Engine.JOB, api_version="batch/v1", kind="Job", namespace="team-a",
        name="train", uid="u-1", phase="Succeeded", finished_at=FINISHED,
        labels={"team": "a"},
    )  # fmt: skip
    return run.model_copy(update=update)


def _config(**store: object) -> ArtifactsConfig:
    spec = {"name": "logs", "url": "s3://bucket/root/", "min_prefix_depth": 3, **store}
    return ArtifactsConfig(stores=(ArtifactStore.model_validate(spec),))


def _judge(
    item: CapturedItem, config: ArtifactsConfig, sharers: tuple[str, ...] = ()
) -> Allowed | Disallowed | Shared:
    """A Job of team-a's (`_run`)."""
    return judge(item, config, sharers, _run(), "job")


# --- judge ---------------------------------------------------------------------------


def test_an_item_inside_the_root_and_deep_enough_is_allowed() -> None:
    item = CapturedItem(store="logs", key="root/team-a/train/", tree=True)
    assert _judge(item, _config()) == Allowed(item)


@pytest.mark.parametrize(
    ("key", "tree", "why"),
    [
        ("root/team-a/", True, "fewer than"),  # 2 parts < 3
        ("other/team-a/train/", True, "outside"),
        ("root//train/", True, "not a clean key"),
        ("root/../x/y/", True, "not a clean key"),
        ("/root/a/b/", True, "not a clean key"),
        ("root/a/b", True, "does not end in '/'"),
    ],
)
def test_shallow_outside_or_unclean_items_are_refused(key: str, tree: bool, why: str) -> None:
    result = _judge(CapturedItem(store="logs", key=key, tree=tree), _config())
    assert isinstance(result, Disallowed)
    assert why in result.reason


def test_an_item_of_a_store_no_longer_configured_is_refused() -> None:
    result = _judge(CapturedItem(store="gone", key="root/a/b/", tree=True), _config())
    assert isinstance(result, Disallowed)
    assert "not configured" in result.reason


def test_an_item_another_run_captured_is_shared() -> None:
    item = CapturedItem(store="logs", key="root/team-a/b/c.tgz", tree=False)
    assert _judge(item, _config(), ("u-2",)) == Shared(item, ("u-2",))


def test_a_refusal_outranks_sharing() -> None:
    item = CapturedItem(store="logs", key="root/team-a/", tree=True)
    assert isinstance(_judge(item, _config(), ("u-2",)), Disallowed)


def test_belongs_takes_the_key_and_what_is_under_it_never_a_sibling() -> None:
    key = CapturedItem(store="logs", key="root/a/b/out.tgz", tree=False)
    assert belongs(key, "root/a/b/out.tgz")
    assert belongs(key, "root/a/b/out.tgz/part-0")
    assert not belongs(key, "root/a/b/out.tgz.bak")
    tree = CapturedItem(store="logs", key="root/a/b/", tree=True)
    assert belongs(tree, "root/a/b/x/y")
    assert not belongs(tree, "root/a/bc/x")
    assert not belongs(tree, "root/a/b")


SEGMENTS = st.sampled_from(["root", "a", "b", "", ".", "..", "x y", "team-a"])


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(SEGMENTS, min_size=0, max_size=5),
    tree=st.booleans(),
    min_depth=st.integers(1, 5),
    root=st.sampled_from(["", "root/", "root/a/"]),
    path_parts=st.lists(SEGMENTS, min_size=1, max_size=7),
)
def test_nothing_allowed_lies_outside_the_root_or_above_the_depth(
    parts: list[str], tree: bool, min_depth: int, root: str, path_parts: list[str]
) -> None:
    key = "/".join(parts) + ("/" if tree else "")
    if not key:
        return
    config = _config(url=f"s3://bucket/{root}", min_prefix_depth=min_depth)
    item = CapturedItem(store="logs", key=key, tree=tree)
    if not isinstance(_judge(item, config), Allowed):
        return
    assert key.startswith(root)
    assert depth(key) >= min_depth
    assert ".." not in key.split("/")
    path = "/".join(path_parts)
    if belongs(item, path):
        assert path.startswith(root)
        assert path.startswith(key) and depth(path) >= min_depth


# --- capture -------------------------------------------------------------------------


def test_declared_templates_render_below_the_root() -> None:
    config = _config(capture={"job": ["logs/{namespace}/{name}/{uid}/", "t/{label:team}/x/"]})
    captured = capture(_run(), "job", None, config)
    assert [i.key for i in captured.items] == ["root/logs/team-a/train/u-1/", "root/t/a/x/"]
    assert all(i.tree for i in captured.items)


def test_a_template_with_a_missing_or_slashed_value_is_not_rendered() -> None:
    assert render("t/{label:missing}/x/", _run()) is None
    assert render("t/{label:team}/x/", _run(labels={"team": "a/b"})) is None
    assert render("runs/{run_id}/", _run()) is None  # no KFP run id
    assert render("runs/{run_id}/", _run(kfp_run_id="r-9")) == "runs/r-9/"


def test_recorded_artifacts_are_captured_only_in_a_store_that_holds_them() -> None:
    config = _config(endpoint="http://minio:9000")
    recorded = RunArtifacts(
        artifacts=(
            StoredArtifact(provider="s3", bucket="bucket", key="root/wf/pod/main.log"),
            StoredArtifact(provider="s3", bucket="other", key="root/wf/pod/out.tgz"),
            StoredArtifact(provider="s3", bucket="bucket", key="elsewhere/out.tgz"),
            StoredArtifact(provider="s3", key="root/wf/pod/x.tgz", endpoint="minio:9000"),
            StoredArtifact(provider="s3", key="root/wf/pod/y.tgz", endpoint="s3.amazonaws.com"),
        )
    )
    captured = capture(_run(), "job", recorded, config, {"s3": "bucket"})
    assert [i.key for i in captured.items] == ["root/wf/pod/main.log", "root/wf/pod/x.tgz"]
    assert not any(i.tree for i in captured.items)
    assert len(captured.outside) == 3


def test_template_validation() -> None:
    with pytest.raises(ValidationError, match="is not one of"):
        _config(capture={"job": ["{bogus}/"]})
    with pytest.raises(ValidationError, match="is a prefix"):
        _config(capture={"job": ["logs/{uid}"]})
    with pytest.raises(ValidationError, match="names no bucket"):
        _config(url="s3:///root/")
    with pytest.raises(ValidationError, match="used twice"):
        ArtifactsConfig.model_validate(
            {"stores": [{"name": "a", "url": "s3://b/"}, {"name": "a", "url": "s3://c/"}]}
        )


# --- the Argo reader -------------------------------------------------------------------


def _workflow(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "metadata": {"name": "wf", "namespace": "argo"},
        "spec": {},
        "status": {
            "artifactRepositoryRef": {
                "configMap": "artifact-repositories", "key": "default-v1", "namespace": "argo",
                "artifactRepository": {"s3": {"bucket": "art", "endpoint": "minio:9000"}},
            },
            "nodes": {
                "wf-1": {"outputs": {"artifacts": [
                    {"name": "main-logs", "s3": {"key": "wf/wf-1/main.log"}},
                    {"name": "model", "s3": {"key": "wf/wf-1/model.tgz", "bucket": "models"}},
                ]}},
                "wf-2": {"outputs": {"artifacts": [{"name": "bad"}]}},
            },
        },
    }  # fmt: skip
    body.update(extra)
    return body


def test_argo_outputs_and_logs_are_read_with_the_repository_bucket() -> None:
    read = argo_artifacts(_workflow())
    assert read is not None and read.collected_by_engine is None
    assert [(a.bucket, a.key) for a in read.artifacts] == [
        ("art", "wf/wf-1/main.log"),
        ("models", "wf/wf-1/model.tgz"),
    ]
    assert read.artifacts[0].endpoint == "minio:9000"


def test_argo_artifact_gc_is_left_to_argo() -> None:
    by_spec = argo_artifacts(_workflow(spec={"artifactGC": {"strategy": "OnWorkflowDeletion"}}))
    assert by_spec is not None and "OnWorkflowDeletion" in (by_spec.collected_by_engine or "")
    finalized = _workflow(
        metadata={"name": "wf", "finalizers": ["workflows.argoproj.io/artifact-gc"]}
    )
    assert "finalizer" in (argo_artifacts(finalized).collected_by_engine or "")  # type: ignore[union-attr]
    never = argo_artifacts(_workflow(spec={"artifactGC": {"strategy": "Never"}}))
    assert never is not None and never.collected_by_engine is None


def test_a_workflow_without_artifacts_records_none() -> None:
    assert argo_artifacts({"metadata": {}, "status": {"nodes": {}}}) is None


# --- the artifacts clock -----------------------------------------------------------------


def test_the_artifacts_clock_defaults_to_the_database_clock() -> None:
    rows = Policy.model_validate({"name": "rows", "database": {"ttl": "7d"}})
    decision = decide(_run(), Target.ARTIFACTS, [rows], FINISHED)
    assert decision.target is Target.ARTIFACTS and decision.action is Action.SCHEDULE
    assert decision.deadline == FINISHED + timedelta(days=7)
    assert decision.policy == "policy:rows" and "database clock" in decision.reason


def test_an_artifacts_clock_of_its_own_wins() -> None:
    policies = [
        Policy.model_validate({"name": "art", "artifacts": {"ttl": "30d"}}),
        Policy.model_validate({"name": "rows", "database": {"ttl": "7d"}}),
    ]
    decision = decide(_run(), Target.ARTIFACTS, policies, FINISHED)
    assert decision.deadline == FINISHED + timedelta(days=30)
    assert decide(_run(), Target.DATABASE, policies, FINISHED).deadline == FINISHED + timedelta(
        days=7
    )


def test_without_any_clock_artifacts_are_kept_like_rows() -> None:
    assert decide(_run(), Target.ARTIFACTS, [], FINISHED).action is Action.CANCEL


def test_the_job_kind_is_named_for_templates() -> None:
    assert DEFAULT_KINDS.of("batch/v1", "Job").name == "job"


def test_an_object_listed_again_with_another_size_or_etag_has_changed() -> None:
    judged = [
        StoredObject("a", 1, '"e1"'),
        StoredObject("b", 2, '"e2"'),
        StoredObject("c", 3, '"e3"'),
        StoredObject("gone", 4, '"e4"'),
    ]
    now = [
        StoredObject("a", 1, '"e1"'),  # as judged
        StoredObject("b", 2, '"other"'),  # written anew, same size
        StoredObject("c", 30, '"e3"'),  # another size
    ]
    # Gone since is no change: deleting it is a no-op.
    assert changed(judged, now) == ["b", "c"]
    assert changed(judged, judged) == []


def test_s3_stores_delete_conditionally_unless_told_not_to_and_only_s3_can() -> None:
    def store(url: str, **extra: object) -> ArtifactStore:
        return ArtifactStore.model_validate({"name": "s", "url": url, **extra})

    assert store("s3://b/").conditional
    assert not store("s3://b/", conditional_delete=False).conditional
    assert not store("gs://b/").conditional and not store("az://b/").conditional
    with pytest.raises(ValidationError, match="conditional_delete is sent to S3 stores only"):
        store("gs://b/", conditional_delete=True)
