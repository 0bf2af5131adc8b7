"""Which keys a run may delete, proved from what its tenant cannot write
(functions/artifact_reaper/ownership.py, the stores' `namespaces`, `kinds` and `roots`).

A tenant writes its runs' status (Argo's Workflow has no status subresource), labels and
annotations; the properties here hold for any key a run records and any namespace: a key
outside the run's rendered roots is never judged deletable, a root that names no single
run is never deleted whole, and what another run records is kept.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lapse.events.adapters.argo_artifacts import argo_references
from lapse.events.artifacts import RunArtifacts, StoredArtifact
from lapse.events.run import Engine, RunRef
from lapse.functions.artifact_reaper.capture import CapturedItem, capture
from lapse.functions.artifact_reaper.ownership import (
    LiveArtifact,
    Protection,
    guarded,
    live_protections,
    roots,
    unowned,
)
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore
from lapse.functions.artifact_reaper.verdict import Allowed, Disallowed, judge

FINISHED = datetime(2026, 1, 1, tzinfo=UTC)


def _run(namespace: str = "team-a", **update: object) -> RunRef:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=namespace, name="wf", uid="u-1", phase="Succeeded", finished_at=FINISHED,
        labels={"team": "team-b", "pipeline/runid": "team-b"},
    )  # fmt: skip
    return run.model_copy(update=update)


def _store(**spec: object) -> ArtifactStore:
    return ArtifactStore.model_validate(
        {"name": "argo", "url": "s3://bucket/", "min_prefix_depth": 2, **spec}
    )


def _config(*stores: ArtifactStore) -> ArtifactsConfig:
    return ArtifactsConfig(stores=stores or (_store(),))


def _judge(key: str, *, tree: bool = False, run: RunRef | None = None, **spec: object) -> object:
    item = CapturedItem(store="argo", key=key, tree=tree)
    return judge(item, _config(_store(**spec)), (), run or _run(), "argo-workflow")


# --- the findings, one by one -----------------------------------------------------------


def test_another_namespaces_finished_directory_is_kept() -> None:
    result = _judge("team-b/their-run")
    assert isinstance(result, Disallowed)
    assert "outside the run's roots" in result.reason and "'team-a/'" in result.reason


def test_a_two_part_key_naming_another_teams_prefix_is_kept_whatever_the_depth() -> None:
    # min_prefix_depth 2 is met by "team-b/data"; the root is what refuses it.
    assert isinstance(_judge("team-b/data", min_prefix_depth=1), Disallowed)
    assert isinstance(_judge("team-b/data/", tree=True, min_prefix_depth=1), Disallowed)


def test_the_runs_own_key_is_allowed_and_its_whole_namespace_is_not() -> None:
    assert isinstance(_judge("team-a/wf/wf-1/main.log"), Allowed)
    whole = _judge("team-a/", tree=True, min_prefix_depth=1)
    assert isinstance(whole, Disallowed) and "no one run's" in whole.reason


def test_a_root_that_names_the_run_may_be_deleted_whole() -> None:
    spec = {"roots": ["{namespace}/{name}/"]}
    assert isinstance(_judge("team-a/wf/", tree=True, **spec), Allowed)
    assert isinstance(_judge("team-a/other-wf/x", **spec), Disallowed)


def test_a_store_serving_other_namespaces_or_kinds_deletes_nothing_for_the_run() -> None:
    other = _judge("team-a/wf/x", namespaces=["team-b"])
    assert isinstance(other, Disallowed) and "does not serve namespace 'team-a'" in other.reason
    tekton = _judge("team-a/wf/x", kinds=["tekton-pipelinerun", "tekton-taskrun"])
    assert isinstance(tekton, Disallowed) and "does not serve kind 'argo-workflow'" in tekton.reason


def test_a_capture_made_before_kinds_were_recorded_is_kept_by_a_store_naming_kinds() -> None:
    item = CapturedItem(store="argo", key="team-a/wf/x", tree=False)
    config = _config(_store(kinds=["argo-workflow"]))
    assert isinstance(judge(item, config, (), _run(), None), Disallowed)


def test_a_label_template_renders_another_tenants_prefix_and_it_is_kept() -> None:
    # The tenant sets label team=team-b on its own run; the template is deprecated and
    # bounded by the run's roots.
    store = _store(capture={"argo-workflow": ["{label:team}/runs/"]})
    captured = capture(_run(), "argo-workflow", None, _config(store))
    (item,) = captured.items
    assert item.key == "team-b/runs/"
    assert isinstance(judge(item, _config(store), (), _run(), "argo-workflow"), Disallowed)
    assert any("deprecated" in warning for warning in store.warnings())


def test_run_id_is_a_label_and_is_bounded_too() -> None:
    store = _store(capture={"argo-workflow": ["{run_id}/"]})
    (item,) = capture(_run(kfp_run_id="team-b"), "argo-workflow", None, _config(store)).items
    assert isinstance(judge(item, _config(store), (), _run(), "argo-workflow"), Disallowed)


def test_a_declared_identity_capture_is_the_runs_own_outside_the_default_root() -> None:
    store = _store(capture={"argo-workflow": ["logs/{namespace}/{uid}/"]})
    (item,) = capture(_run(), "argo-workflow", None, _config(store)).items
    assert item.key == "logs/team-a/u-1/"
    assert isinstance(judge(item, _config(store), (), _run(), "argo-workflow"), Allowed)
    # The same prefix recorded by another namespace's run is not that run's.
    other = _run("team-c", uid="u-9")
    assert isinstance(judge(item, _config(store), (), other, "argo-workflow"), Disallowed)


def test_an_argo_runs_key_never_reaches_a_store_serving_tekton_only() -> None:
    tekton = ArtifactStore.model_validate(
        {
            "name": "tekton-logs", "url": "s3://tekton-logs/", "min_prefix_depth": 3,
            "kinds": ["tekton-pipelinerun", "tekton-taskrun"],
            "capture": {"tekton-pipelinerun": ["logs/{namespace}/{uid}/"]},
        }
    )  # fmt: skip
    recorded = RunArtifacts(
        artifacts=(StoredArtifact(provider="s3", bucket="tekton-logs", key="logs/team-b/x/y"),)
    )
    captured = capture(_run(), "argo-workflow", recorded, _config(tekton))
    assert captured.items == ()
    assert captured.outside == ("s3://tekton-logs/logs/team-b/x/y",)


# --- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "root", ["{label:team}/", "{annotation:a}/", "{run_id}/", "/x/", "x", "a//", "../"]
)
def test_a_root_is_rendered_from_the_runs_identity_only(root: str) -> None:
    with pytest.raises(ValidationError):
        _store(roots=[root])


def test_a_store_with_no_namespace_bound_is_warned_of() -> None:
    assert _store().warnings() == []  # the default root names {namespace}
    [warning] = _store(roots=[""]).warnings()
    assert "bounds no namespace" in warning
    assert _store(roots=[""], namespaces=["team-a"]).warnings() == []
    assert _store(roots=["{name}/"], namespaces=["team-*"]).warnings() != []


def test_existing_configuration_keeps_validating() -> None:
    store = _store(capture={"job": ["logs/{namespace}/{name}/{uid}/", "t/{label:x}/"]})
    assert store.roots == ("{namespace}/",) and store.namespaces == ("*",)
    assert store.kinds is None


# --- other runs' keys -------------------------------------------------------------------


def test_live_runs_keys_protect_in_every_store_that_may_hold_them() -> None:
    config = _config(_store(), _store(name="other", url="s3://other/"))
    live = [
        LiveArtifact("team-b/running", "u-2", StoredArtifact(provider="s3", key="team-b/ckpt/")),
        LiveArtifact("team-a/wf", "u-1", StoredArtifact(provider="s3", key="team-a/wf/x")),
        LiveArtifact("x/y", "u-3", StoredArtifact(provider="gcs", bucket="b", key="k/l")),
    ]
    found = live_protections(config, live, "u-1")
    assert {(p.item.store, p.item.key, p.by) for p in found} == {
        ("argo", "team-b/ckpt", ("team-b/running",)),
        ("other", "team-b/ckpt", ("team-b/running",)),
    }
    assert guarded("argo", "team-b/ckpt/step-3", found) is not None
    assert guarded("argo", "team-b/ckpt", found) is not None
    assert guarded("argo", "team-b/ckpt2", found) is None


def test_argo_references_reads_inputs_and_skips_unrendered_templates() -> None:
    body = {
        "spec": {
            "arguments": {"artifacts": [{"name": "a", "s3": {"key": "team-b/in/data"}}]},
            "templates": [{"inputs": {"artifacts": [{"s3": {"key": "{{inputs.x}}/y"}}]}}],
        },
        "status": {
            "nodes": {
                "n": {
                    "inputs": {"artifacts": [{"s3": {"bucket": "b", "key": "shared/m"}}]},
                    "outputs": {"artifacts": [{"s3": {"key": "team-b/ckpt"}}]},
                }
            }
        },
    }
    assert {a.key for a in argo_references(body)} == {"team-b/in/data", "shared/m", "team-b/ckpt"}


# --- properties -------------------------------------------------------------------------

PARTS = st.sampled_from(["team-a", "team-b", "wf", "u-1", "x", "logs", "", ".", ".."])
NAMESPACES = st.sampled_from(["team-a", "team-b", "ci-1"])
ROOTS = st.sampled_from(
    ["{namespace}/", "{namespace}/{name}/", "a/{namespace}/", "{uid}/", "logs/{namespace}/"]
)


@settings(max_examples=500, deadline=None)
@given(
    parts=st.lists(PARTS, min_size=1, max_size=5),
    tree=st.booleans(),
    namespace=NAMESPACES,
    root=ROOTS,
    url_root=st.sampled_from(["", "art/"]),
    min_depth=st.integers(1, 3),
    labels=st.dictionaries(st.sampled_from(["team", "x"]), PARTS, max_size=2),
)
def test_no_recorded_key_outside_the_runs_rendered_root_is_ever_deletable(
    parts: list[str],
    tree: bool,
    namespace: str,
    root: str,
    url_root: str,
    min_depth: int,
    labels: dict[str, str],
) -> None:
    key = url_root + "/".join(parts) + ("/" if tree else "")
    if not key:
        return
    store = _store(url=f"s3://bucket/{url_root}", roots=[root], min_prefix_depth=min_depth)
    run = _run(namespace, labels=labels)
    item = CapturedItem(store="argo", key=key, tree=tree)
    if not isinstance(judge(item, _config(store), (), run, "argo-workflow"), Allowed):
        return
    (rendered,) = roots(store, run)
    assert key.startswith(rendered.prefix)
    assert len(key) > len(rendered.prefix) or rendered.one_run
    assert unowned(item, store, run, "argo-workflow") is None
    # And nothing of another namespace's: its root never holds the key (unless the roots
    # are per uid, where the namespace is not in the key at all).
    if "{namespace}" in root:
        for other in ("team-a", "team-b", "ci-1"):
            if other != namespace:
                (theirs,) = roots(store, _run(other))
                assert not key.startswith(theirs.prefix)


@settings(max_examples=300, deadline=None)
@given(
    recorded=st.lists(st.lists(PARTS.filter(bool), min_size=1, max_size=4), min_size=1, max_size=4),
    path=st.lists(PARTS, min_size=1, max_size=6),
)
def test_a_path_at_or_under_a_key_another_run_records_is_guarded(
    recorded: list[list[str]], path: list[str]
) -> None:
    protections = [
        Protection(CapturedItem(store="argo", key="/".join(p), tree=False), ("u-2",))
        for p in recorded
    ]
    joined = "/".join(path)
    keeps = guarded("argo", joined, protections)
    expected = any(joined == "/".join(p) or joined.startswith("/".join(p) + "/") for p in recorded)
    assert (keeps is not None) == expected
