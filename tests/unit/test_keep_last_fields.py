"""keep_last grouped by a field of the object (`group_by: field:<path>`): the path, the
value, the group a listed run is in, and the count of a whole namespace's listing, which is
what a field group costs (fields are not selectable server-side: docs/architecture.md,
"Keep the last N")."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.events.adapters import adapt_workflow
from lapse.events.kinds import ARGO_WORKFLOW
from lapse.functions.keep_last import (
    KeepLast,
    ListedRun,
    field_value,
    listed_object,
    parse_field_path,
)
from lapse.functions.object_reaper.verdict import Delete, Reschedule, classify, counts
from lapse.functions.policy import Policy, counted_out, keep_last_group
from lapse.functions.policy_objects import effective
from lapse.functions.safety import SafetyConfig
from tests.unit.test_keep_last import (
    CRON,
    NOW,
    Scenario,
    interleave,
    namespace_of,
    nightly,
    refs,
    run,
    scenarios,
)
from tests.unit.test_object_reaper_verdict import argo_workflow, as_read, due_for
from tests.unit.test_policy_objects import ALLOW_TEAMS, lapse_policy

TEMPLATE = "field:spec.workflowTemplateRef.name"
PIPELINE = "field:spec.pipelineRef.name"


def by_template(**counts: Any) -> Policy:
    return Policy.model_validate(
        {"name": "templates", "keep_last": {"group_by": TEMPLATE, **counts}}
    )


# --- the path and the value ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "keys"),
    [
        ("spec.workflowTemplateRef.name", ("spec", "workflowTemplateRef", "name")),
        ("spec.pipelineRef.name", ("spec", "pipelineRef", "name")),
        (
            "metadata.annotations['pipelines.kubeflow.org/run_name']",
            ("metadata", "annotations", "pipelines.kubeflow.org/run_name"),
        ),
        ('metadata.labels["a.b/c"].x', ("metadata", "labels", "a.b/c", "x")),
    ],
)
def test_a_field_path_names_its_keys(path: str, keys: tuple[str, ...]) -> None:
    assert parse_field_path(path) == keys
    assert KeepLast.model_validate({"group_by": f"field:{path}", "total": 1}).field_path == keys


@pytest.mark.parametrize(
    "path", ["", ".spec", "spec.", "spec..name", "spec name", "spec.['x']", "a['x']b", "a[x]"]
)
def test_a_malformed_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="is not a field path"):
        parse_field_path(path)


_KEY = st.text(alphabet="abcXYZ019_-", min_size=1, max_size=6)
_DOTTED_KEY = st.text(alphabet="ab./-", min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.one_of(_KEY, _DOTTED_KEY), min_size=1, max_size=6),
    value=st.one_of(
        st.text(min_size=1, max_size=5), st.integers(), st.booleans(), st.none(),
        st.just(""), st.just({}), st.just(["x"]),
    ),
)  # fmt: skip
def test_the_value_read_is_the_value_written(keys: list[str], value: Any) -> None:
    """Any path written with its keys (a key that is not a plain name in brackets) reads
    back the scalar stored there: a non-empty string, an integer's digits; nothing else
    names a group."""
    path = keys[0] if _plain(keys[0]) else f"['{keys[0]}']"
    for key in keys[1:]:
        path += f".{key}" if _plain(key) else f"['{key}']"
    assert parse_field_path(path) == tuple(keys)
    obj: Any = value
    for key in reversed(keys):
        obj = {key: obj, "other": "x"}
    expected = (
        str(value)
        if isinstance(value, int) and not isinstance(value, bool)
        else value
        if isinstance(value, str) and value
        else None
    )
    assert field_value(obj, tuple(keys)) == expected
    # One key short (a map) and one key too many (through a scalar) name no group.
    assert field_value(obj, tuple(keys[:-1])) is None
    assert field_value(obj, (*keys, "deeper")) is None


def _plain(key: str) -> bool:
    return all(c.isalnum() or c in "_-" for c in key)


# --- the group ---------------------------------------------------------------------------


def test_a_listed_run_is_grouped_by_its_field_and_a_run_event_is_not_yet() -> None:
    policies = [by_template(total=1)]
    obj = run("a", 5, group="etl", by="field")
    listed = refs([obj])[0]
    assert isinstance(listed, ListedRun) and listed_object(listed) is obj
    found = keep_last_group(listed, policies)
    assert found is not None
    group = found[0]
    assert (group.field, group.label, group.value) == (True, "spec.workflowTemplateRef.name", "etl")
    # Not selectable server-side: the namespace is listed and filtered here.
    assert group.selector == ""
    # A run event carries no fields: its group is settled by the listing.
    event_run = adapt_workflow(obj)
    unknown = keep_last_group(event_run.run, policies)  # type: ignore[union-attr]
    assert unknown is not None and unknown[0].value is None and unknown[0].selector == ""
    # Serialized (an event), a listed run is a RunRef: the object is not carried along.
    assert "listed_object" not in listed.model_dump() and "object" not in listed.model_dump()


def test_a_run_without_the_field_is_asked_of_the_next_policy() -> None:
    by_cron = nightly(total=1)
    policies = [by_template(total=1), by_cron]
    cron_run = refs([run("c", 5, group="nightly")])[0]  # a label, no workflowTemplateRef
    found = keep_last_group(cron_run, policies)
    assert found is not None and found[0].policy == "nightly" and not found[0].field
    templated = refs([run("t", 5, group="etl", by="field")])[0]
    found = keep_last_group(templated, policies)
    assert found is not None and found[0].policy == "templates"


def test_a_tekton_pipeline_run_is_grouped_by_its_pipeline_ref() -> None:
    rule = KeepLast.model_validate({"group_by": PIPELINE, "total": 2})
    pipeline_run = {"spec": {"pipelineRef": {"name": "build"}}}
    assert rule.field_path is not None
    assert field_value(pipeline_run, rule.field_path) == "build"
    assert rule.group_label({"tekton.dev/pipeline": "build"}) is None  # a field, not a label


# --- the count over a namespace ----------------------------------------------------------


def test_a_namespace_listing_counts_each_template_apart() -> None:
    objects = [run(f"etl{i}", 10 * i, group="etl", by="field") for i in range(4)]
    objects += [run(f"rep{i}", 10 * i + 5, group="report", by="field") for i in range(2)]
    objects.append(run("adhoc", 1, by="label", group="cron"))  # neither: no template
    objects.append(run("pinned", 0, group="etl", by="field", keep=True))
    out = counted_out(refs(objects), [by_template(total=2)], NOW)
    assert sorted(out) == ["uid-etl2", "uid-etl3"]
    # etl2 is pushed out by etl0 (2 places newer), when etl0 finished.
    assert out["uid-etl2"][1].at == NOW and out["uid-etl2"][1].pushed_out_by == "etl0"
    assert out["uid-etl2"][0].describe() == "field spec.workflowTemplateRef.name='etl'"


def test_runs_not_listed_are_never_counted_by_a_field() -> None:
    """Plain run references (`lapse plan` adapts objects itself) carry no fields: their
    field group is unknown, so nothing is counted out rather than all lumped together."""
    objects = [run(f"r{i}", i, group=f"t{i}", by="field") for i in range(3)]
    plain = [adapt_workflow(o).run for o in objects]  # type: ignore[union-attr]
    assert counted_out(plain, [by_template(total=1)], NOW) == {}
    assert len(counted_out(refs(objects), [by_template(total=0)], NOW)) == 3


@st.composite
def namespaces(draw: st.DrawFn) -> list[dict[str, Any]]:
    objects = []
    for i in range(draw(st.integers(min_value=0, max_value=25))):
        by = draw(st.sampled_from(["field", "field", "label"]))
        objects.append(
            run(
                f"r{i}",
                minutes_ago=draw(st.integers(min_value=0, max_value=40)),
                phase=draw(st.sampled_from(["Succeeded", "Failed"])),
                group=draw(st.sampled_from(["a", "b", "c"])),
                keep=draw(st.integers(min_value=0, max_value=4)) == 0,
                by=by,
            )
        )
    return objects


@settings(max_examples=300, deadline=None)
@given(objects=namespaces(), limit=st.integers(min_value=0, max_value=4))
def test_counting_the_namespace_is_counting_each_group_alone(
    objects: list[dict[str, Any]], limit: int
) -> None:
    """What makes listing the whole namespace right: the count of a listing that holds
    groups whole is, for each group, the count of that group listed alone."""
    policies = [by_template(succeeded=limit, failed=1), nightly(total=limit)]
    whole = counted_out(refs(objects), policies, NOW)
    groups: dict[Any, list[dict[str, Any]]] = {}
    for obj, ref in zip(objects, refs(objects), strict=True):
        found = keep_last_group(ref, policies)
        if found is not None:
            groups.setdefault(found[0], []).append(obj)
    alone: dict[str, Any] = {}
    for members in groups.values():
        alone |= counted_out(refs(members), policies, NOW)
    assert whole == alone


@settings(max_examples=200, deadline=None)
@given(scenarios(by="field"))
def test_every_interleaving_keeps_exactly_the_newest_n_of_each_template(
    scenario: Scenario,
) -> None:
    """The concurrency property (tests/unit/test_keep_last.py) for a field group, whose
    every LIST is the whole namespace."""
    interleave(scenario, namespace_of)


# --- the reaper's recount ----------------------------------------------------------------


def test_the_reaper_recounts_a_field_group_from_the_namespace() -> None:
    policies = [
        Policy.model_validate(
            {
                "name": "templates",
                "kubernetes": {"ttl": "7d"},
                "keep_last": {"group_by": TEMPLATE, "succeeded": 1},
            }
        )
    ]
    old, new = run("old", 20, by="field"), run("new", 10, by="field")
    other = run("other", 5, group="report", by="field")
    due = due_for(old, NOW - timedelta(minutes=10), policy="keep_last:templates")
    first = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW)
    assert isinstance(first, Reschedule)
    assert counts(first, policies) == ""  # the namespace, whole
    namespace = [old, new, other]
    verdict = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), namespace)
    assert isinstance(verdict, Delete) and verdict.policy == "keep_last:templates"
    # Another template's newer run does not push it out.
    alone = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [old, other])
    assert isinstance(alone, Reschedule) and alone.policy == "policy:templates"
    # Nor does its template change since (the listing is what counts).
    renamed = as_read(argo_workflow("new", finished_at=NOW), uid="uid-new")
    renamed["spec"]["workflowTemplateRef"] = {"name": "report"}
    moved = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [old, renamed])
    assert isinstance(moved, Reschedule)
    assert CRON not in old["metadata"]["labels"]


def test_a_lapse_policy_may_group_by_a_field_in_its_own_namespace() -> None:
    spec = {"keepLast": {"groupBy": TEMPLATE, "total": 1}}
    found = effective([lapse_policy("tpl", "team-a", spec)], [ALLOW_TEAMS])
    assert found.verdicts[0].accepted, found.verdicts[0]
    objects = [run(f"r{i}", i, group="etl", by="field") for i in range(3)]
    assert sorted(counted_out(refs(objects), found.policies, NOW)) == ["uid-r1", "uid-r2"]
    elsewhere = as_read(argo_workflow("x", namespace="team-b", finished_at=NOW), uid="uid-x")
    elsewhere["spec"]["workflowTemplateRef"] = {"name": "etl"}
    assert keep_last_group(refs([elsewhere])[0], found.policies) is None
