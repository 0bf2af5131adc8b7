"""What the row-reaper deletes for a run and a configuration, and where keys come from."""

from __future__ import annotations

from typing import Any

import pytest

from lapse.config import DatabaseTargets
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef
from lapse.functions.row_reaper.targets import (
    KeySource,
    MissingKey,
    Step,
    argo_archive_target,
    keys_for,
    kfp_target,
    targets_for,
)


def run(**fields: Any) -> RunRef:
    base: dict[str, Any] = {
        "engine": Engine.ARGO,
        "api_version": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "namespace": "team-a",
        "name": "train-7",
        "uid": "0f6b7c1e-uid",
        "phase": "Succeeded",
    }
    return RunRef(**(base | fields))


# --- key sources -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("uid", KeySource("uid")),
        ("name", KeySource("name")),
        ("label:pipeline/runid", KeySource("label", "pipeline/runid")),
        ("annotation:example.com/id", KeySource("annotation", "example.com/id")),
        ("label:a:b", KeySource("label", "a:b")),
    ],
)
def test_key_source_parses_the_configuration_syntax(text: str, expected: KeySource) -> None:
    assert KeySource.parse(text) == expected


@pytest.mark.parametrize("text", ["", "uid:x", "label:", "annotation", "labels:x", "UID"])
def test_key_source_rejects_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="is not a key source"):
        KeySource.parse(text)


def test_keys_come_from_uid_name_label_and_annotation() -> None:
    subject = run(labels={"team": "vision"}, annotations={"example.com/id": "42"})

    assert KeySource("uid").of(subject) == "0f6b7c1e-uid"
    assert KeySource("name").of(subject) == "train-7"
    assert KeySource("label", "team").of(subject) == "vision"
    assert KeySource("annotation", "example.com/id").of(subject) == "42"


def test_kfp_run_id_comes_from_the_field_or_else_the_label() -> None:
    source = KeySource("kfp_run_id")

    assert source.of(run(kfp_run_id="r-field", labels={KFP_RUN_ID_LABEL: "r-label"})) == "r-field"
    assert source.of(run(labels={KFP_RUN_ID_LABEL: "r-label"})) == "r-label"


@pytest.mark.parametrize(
    ("source", "fields", "message"),
    [
        (KeySource("label", "team"), {}, "label 'team' is not set on team-a/train-7"),
        (
            KeySource("annotation", "example.com/id"),
            {"labels": {"example.com/id": "1"}},  # a label of that name is not an annotation
            "annotation 'example.com/id' is not set on team-a/train-7",
        ),
        (KeySource("label", "team"), {"labels": {"team": "  "}}, "label 'team' is empty"),
        (
            KeySource("kfp_run_id"),
            {},
            f"the KFP run id (label {KFP_RUN_ID_LABEL}) is not set on team-a/train-7",
        ),
    ],
)
def test_missing_or_empty_keys_say_which_and_where(
    source: KeySource, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(MissingKey) as caught:
        source.of(run(**fields))
    assert caught.value.reason.startswith(message)


# --- built-in targets --------------------------------------------------------------------


def test_kfp_deletes_in_kfps_own_order_keyed_by_the_run_id() -> None:
    target = kfp_target()

    assert target.key == KeySource("kfp_run_id")
    assert target.locks_parent
    # The run id is a label's word; run_details.Namespace is KFP's record of whose run it is.
    assert target.parent == Step(
        "run_details",
        "UUID",
        "database.targets.kfp",
        "database.targets.kfp",
        namespace_column="Namespace",
        namespace_default="kubeflow",  # KFP's single-user runs record none
    )
    assert target.namespace_column == "Namespace"
    assert [(s.table, s.column, s.where, s.namespace_column) for s in target.steps] == [
        ("run_metrics", "RunUUID", (), None),
        ("tasks", "RunUUID", (), None),
        ("resource_references", "ResourceUUID", (("ResourceType", "Run"),), None),
        ("run_details", "UUID", (), "Namespace"),
    ]


def test_argo_archive_is_scoped_to_the_cluster_and_keyed_by_uid() -> None:
    target = argo_archive_target("prod-eu")

    assert target.key == KeySource("uid")
    assert target.locks_parent
    cluster = (("clustername", "prod-eu"),)
    assert [(s.table, s.column, s.where, s.namespace_column) for s in target.steps] == [
        ("argo_archived_workflows_labels", "uid", cluster, None),
        ("argo_archived_workflows", "uid", cluster, "namespace"),
        ("argo_workflows", "uid", cluster, "namespace"),
    ]
    assert target.namespace_column == "namespace"


# --- from configuration ------------------------------------------------------------------


def test_declared_tables_keep_their_config_keys_and_children_come_first() -> None:
    config = DatabaseTargets.model_validate(
        {
            "tables": [
                {"name": "plain", "table": "runs", "key_column": "uid"},
                {
                    "name": "artifacts",
                    "table": "ml.run_artifacts",
                    "key_column": "run_id",
                    "key_from": "label:pipeline/runid",
                    "children": [
                        {"table": "ml.artifact_files", "foreign_key_column": "run_id"},
                        {"table": "ml.artifact_tags", "foreign_key_column": "artifact_id"},
                    ],
                },
            ]
        }
    )

    plain, artifacts = targets_for(config)

    assert plain.key == KeySource("uid") and not plain.locks_parent
    assert [s.table for s in plain.steps] == ["runs"]
    assert artifacts.key == KeySource("label", "pipeline/runid")
    assert [s.table for s in artifacts.steps] == [
        "ml.artifact_files",
        "ml.artifact_tags",
        "ml.run_artifacts",
    ]
    assert artifacts.parent.table_key == "database.targets.tables[1].table"
    assert artifacts.parent.column_key == "database.targets.tables[1].key_column"
    assert artifacts.children[1].table_key == "database.targets.tables[1].children[1].table"
    assert (
        artifacts.children[1].column_key
        == "database.targets.tables[1].children[1].foreign_key_column"
    )


def test_only_enabled_targets_built_ins_first() -> None:
    nothing = DatabaseTargets()
    everything = DatabaseTargets.model_validate(
        {
            "kfp": {"enabled": True},
            "argo_archive": {"enabled": True, "cluster_name": "c1"},
            "ml_metadata": {"enabled": True, "database": "metadb"},
            "tekton_results": {"enabled": True},
            "tables": [{"name": "mine", "table": "t", "key_column": "k"}],
        }
    )

    assert targets_for(nothing) == []
    targets = targets_for(everything)
    assert [t.name for t in targets] == [
        "kfp", "argo_archive", "ml_metadata", "tekton_results", "mine"
    ]  # fmt: skip
    assert targets[1].parent.where == (("clustername", "c1"),)
    # MLMD's run context, in the named database, found by the KFP run id.
    assert targets[2].parent.table == "metadb.Context" and targets[2].graph == "mlmd"
    assert targets[2].key.kind == "kfp_run_id"
    assert [t.config_key for t in targets] == [
        "database.targets.kfp",
        "database.targets.argo_archive",
        "database.targets.ml_metadata",
        "database.targets.tekton_results",
        "database.targets.tables[0]",
    ]


def test_keys_for_a_run_skip_the_targets_it_has_no_key_for() -> None:
    targets = targets_for(
        DatabaseTargets.model_validate(
            {
                "kfp": {"enabled": True},
                "argo_archive": {"enabled": True},
                "tables": [
                    {"name": "by-team", "table": "t", "key_column": "k", "key_from": "label:team"}
                ],
            }
        )
    )

    keys = keys_for(run(), targets)

    assert keys.keys == {"argo_archive": "0f6b7c1e-uid"}
    assert set(keys.skipped) == {"kfp", "by-team"}
    assert "label 'team' is not set" in keys.skipped["by-team"]
