"""keep_last: the clause, the count, and the count under every interleaving.

The property test plays planners (list the group when a run finishes, schedule what the
count puts out) and reapers (read the object, list the group, judge with the real
`classify`, DELETE held to the version read) as steps that hypothesis interleaves in any
order, against one in-memory "API server". Whatever the order, the newest N of each bucket
exist after every step, and once every step has run exactly they are left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lapse.events.kinds import ARGO_WORKFLOW
from lapse.events.run import RunRef, Target
from lapse.functions.keep_last import KeepLast, listed_runs
from lapse.functions.object_reaper.verdict import Delete, Kept, Reschedule, classify, counts
from lapse.functions.policy import (
    Action,
    Policy,
    counted_out,
    decide,
    keep_last_group,
    with_count,
)
from lapse.functions.safety import SafetyConfig
from tests.unit.test_object_reaper_verdict import argo_workflow, as_read, due_for

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
CRON = "workflows.argoproj.io/cron-workflow"


def nightly(**keep_last: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": "nightly",
            "kubernetes": {"ttl": "7d"},
            "keep_last": {"group_by": f"label:{CRON}", **keep_last},
        }
    )


def run(
    name: str,
    minutes_ago: int,
    phase: str = "Succeeded",
    group: str = "etl",
    keep: bool = False,
    rv: str = "1",
    by: str = "label",
) -> dict[str, Any]:
    """A finished Workflow of `group`: by its cron label, or (`by="field"`) by the
    WorkflowTemplate it was submitted from, without the label."""
    annotations = {"lapse.dev/keep": "true"} if keep else {}
    body = argo_workflow(
        name,
        phase=phase,
        finished_at=NOW - timedelta(minutes=minutes_ago),
        labels={CRON: group} if by == "label" else {},
        annotations=annotations,
    )
    if by == "field":
        body["spec"]["workflowTemplateRef"] = {"name": group}
    return as_read(body, uid=f"uid-{name}", rv=rv)


def group_key(obj: Mapping[str, Any]) -> str:
    """The group an object of `run` is in, read apart from the code under test."""
    labels = obj["metadata"]["labels"]
    return str(labels[CRON] if CRON in labels else obj["spec"]["workflowTemplateRef"]["name"])


def refs(objects: list[dict[str, Any]]) -> list[RunRef]:
    return listed_runs(objects, ARGO_WORKFLOW)


# --- the clause -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({}, "set total, or succeeded and/or failed"),
        ({"total": 3, "failed": 1}, "not both"),
        ({"succeeded": -1}, "greater than or equal to 0"),
        ({"total": 2, "group_by": "field:spec..name"}, "is not a field path"),
        ({"total": 2, "group_by": "field:"}, "is not a field path"),
        ({"total": 2, "group_by": "annotation:x"}, "is not a group"),
        ({"total": 2, "group_by": "label:bad key"}, "is not a group"),
        ({"total": 2, "extra": 1}, "Extra inputs"),
    ],
)
def test_a_bad_clause_is_refused(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        KeepLast.model_validate(fields)


def test_a_policy_may_set_only_keep_last() -> None:
    policy = Policy.model_validate({"name": "n", "keep_last": {"total": 2}})
    assert policy.keep_last == KeepLast(total=2)
    assert policy.kubernetes is None


def test_auto_groups_by_the_engines_own_labels_most_specific_first() -> None:
    rule = KeepLast(total=1)
    both = {CRON: "nightly", "workflows.argoproj.io/workflow-template": "etl"}
    assert rule.group_label(both) == (CRON, "nightly")
    kfp = {"scheduledworkflows.kubeflow.org/scheduledWorkflowName": "daily-train"}
    assert rule.group_label(kfp) == (*kfp.items(),)[0]
    assert rule.group_label({"tekton.dev/pipeline": "build"}) == ("tekton.dev/pipeline", "build")
    assert rule.group_label({"team": "a"}) is None


def test_a_run_without_the_group_label_is_asked_of_the_next_policy() -> None:
    by_team = Policy.model_validate(
        {"name": "t", "keep_last": {"group_by": "label:team", "total": 1}}
    )
    policies = [nightly(total=3), by_team]
    ref = refs([run("a", 5)])[0]
    found = keep_last_group(ref, policies)
    assert found is not None and found[0].policy == "nightly"
    stray = ref.model_copy(update={"labels": {"team": "x"}})
    found = keep_last_group(stray, policies)
    assert found is not None and found[0].selector == "team=x"


# --- the count --------------------------------------------------------------------------


def test_the_oldest_beyond_n_are_counted_out_per_bucket() -> None:
    objects = [run(f"s{i}", minutes_ago=10 * i) for i in range(5)]  # s0 newest
    objects += [run(f"f{i}", minutes_ago=10 * i + 5, phase="Failed") for i in range(3)]
    objects.append(run("e", minutes_ago=1, phase="Error"))  # Error is a failure
    out = counted_out(refs(objects), [nightly(succeeded=3, failed=1)], NOW)
    assert sorted(out) == ["uid-f0", "uid-f1", "uid-f2", "uid-s3", "uid-s4"]
    # Due when the run that pushed it out finished: s3 when s0 did, f0 when e did.
    assert out["uid-s3"][1].at == NOW
    assert out["uid-s4"][1].at == NOW - timedelta(minutes=10)
    assert out["uid-f0"][1].at == NOW - timedelta(minutes=1)


def test_total_counts_every_phase_together() -> None:
    objects = [run("a", 1), run("b", 2, phase="Failed"), run("c", 3)]
    assert list(counted_out(refs(objects), [nightly(total=2)], NOW)) == ["uid-c"]


def test_kept_runs_are_never_counted_out_and_do_not_count() -> None:
    objects = [run("pinned", 1, keep=True), run("a", 2), run("b", 3), run("c", 4)]
    out = counted_out(refs(objects), [nightly(succeeded=2)], NOW)
    assert list(out) == ["uid-c"]  # a and b stay besides the pinned run


def test_other_groups_and_other_namespaces_are_counted_apart() -> None:
    objects = [run("a", 1), run("b", 2), run("x", 3, group="other"), run("y", 4, group="other")]
    elsewhere = argo_workflow("z", namespace="team-b", finished_at=NOW, labels={CRON: "etl"})
    objects.append(as_read(elsewhere, uid="uid-z"))
    out = counted_out(refs(objects), [nightly(total=1)], NOW)
    assert sorted(out) == ["uid-b", "uid-y"]


def test_runs_being_deleted_or_running_again_are_not_counted() -> None:
    deleting = run("d", 1)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-21T11:59:00Z"
    running = run("r", 2, phase="Running")
    assert [r.name for r in refs([deleting, running, run("a", 3)])] == ["a"]


def test_whichever_comes_first_deletes() -> None:
    policies = [nightly(total=1)]
    objects = [run("a", 1), run("old", 60 * 24 * 8)]  # old's 7d TTL ended a day ago
    out = counted_out(refs(objects), policies, NOW)
    old = refs(objects)[1]
    own = decide(old, Target.KUBERNETES, policies, NOW)
    assert with_count(own, out["uid-old"]) == own  # the TTL came first
    young = refs([run("b", 2)])[0]
    merged = with_count(decide(young, Target.KUBERNETES, policies, NOW), out["uid-old"])
    assert merged.policy == "keep_last:nightly" and merged.action is Action.SCHEDULE


def test_a_ttl_of_never_does_not_outlast_the_count_but_keep_does() -> None:
    forever = Policy.model_validate(
        {"name": "forever", "kubernetes": {"ttl": "never"}, "keep_last": {"total": 0}}
    )
    ref = refs([run("a", 1)])[0]
    counted = counted_out([ref], [forever], NOW)["uid-a"]
    assert with_count(decide(ref, Target.KUBERNETES, [forever], NOW), counted).action is (
        Action.SCHEDULE
    )
    kept = refs([run("k", 1, keep=True)])[0]
    keep_decision = decide(kept, Target.KUBERNETES, [forever], NOW)
    assert with_count(keep_decision, counted).action is Action.CANCEL


# --- the reaper's judgement -------------------------------------------------------------


def test_the_reaper_deletes_a_counted_out_run_only_from_the_group_as_listed() -> None:
    policies = [nightly(succeeded=1)]
    old, new = run("old", 20), run("new", 10)
    due = due_for(old, NOW - timedelta(minutes=10), policy="keep_last:nightly")
    first = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW)
    assert isinstance(first, Reschedule)  # its 7d TTL says not yet
    assert counts(first, policies) == f"{CRON}=etl"
    verdict = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [old, new])
    assert isinstance(verdict, Delete)
    assert verdict.policy == "keep_last:nightly" and verdict.resource_version == "1"
    # The newer run is gone now: the old one is the last, and stays until its TTL.
    alone = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [old])
    assert isinstance(alone, Reschedule) and alone.policy == "policy:nightly"


def test_the_reaper_counts_a_run_whose_ttl_is_never() -> None:
    forever = Policy.model_validate(
        {"name": "forever", "kubernetes": {"ttl": "never"}, "keep_last": {"total": 1}}
    )
    old, new = run("old", 20), run("new", 10)
    due = due_for(old, NOW - timedelta(minutes=10), policy="keep_last:forever")
    first = classify(old, due, ARGO_WORKFLOW, [forever], SafetyConfig(), NOW)
    assert isinstance(first, Kept)
    assert counts(first, [forever]) == f"{CRON}=etl"
    verdict = classify(old, due, ARGO_WORKFLOW, [forever], SafetyConfig(), NOW, (), [old, new])
    assert isinstance(verdict, Delete) and verdict.policy == "keep_last:forever"


def test_the_reaper_keeps_a_pinned_run_whatever_the_count() -> None:
    policies = [nightly(succeeded=0)]
    pinned = run("p", 20, keep=True)
    due = due_for(pinned, NOW, policy="keep_last:nightly")
    first = classify(pinned, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW)
    assert isinstance(first, Kept) and counts(first, policies) is None  # not even listed
    verdict = classify(pinned, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [pinned])
    assert isinstance(verdict, Kept)


# --- every interleaving -----------------------------------------------------------------


@dataclass
class World:
    """One API server (objects by uid, a resourceVersion each) and the work in flight."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)


@dataclass
class Planner:
    """One run's finish event: list the group, then schedule what is counted out."""

    uid: str
    listed: list[dict[str, Any]] | None = None


@dataclass
class Reaper:
    """One due event: GET, LIST the group, judge, DELETE held to the version read."""

    uid: str
    read: dict[str, Any] | None = None
    listed: list[dict[str, Any]] | None = None
    done: bool = False


GROUPS = ("etl", "other")


Scenario = tuple[list[dict[str, Any]], list[int], Policy]


@st.composite
def scenarios(draw: st.DrawFn, by: str = "label") -> Scenario:
    count = draw(st.integers(min_value=1, max_value=14))
    objects = []
    for i in range(count):
        objects.append(
            run(
                f"r{i}",
                minutes_ago=draw(st.integers(min_value=0, max_value=30)),
                phase=draw(st.sampled_from(["Succeeded", "Failed", "Error"])),
                group=draw(st.sampled_from(GROUPS)),
                keep=draw(st.integers(min_value=0, max_value=3)) == 0,
                by=by,
            )
        )
    # Which step goes next, as indices into what is pending then (taken modulo).
    choices = draw(st.lists(st.integers(min_value=0, max_value=99), max_size=300))
    rule = draw(
        st.one_of(
            st.builds(
                dict,
                succeeded=st.integers(min_value=0, max_value=4),
                failed=st.integers(min_value=0, max_value=2),
            ),
            st.builds(dict, total=st.integers(min_value=0, max_value=5)),
        )
    )
    if by == "field":
        rule["group_by"] = "field:spec.workflowTemplateRef.name"
    return objects, choices, nightly(**rule)


def expected_survivors(objects: list[dict[str, Any]], policy: Policy) -> set[str]:
    """Computed apart from the code under test: per group and bucket, the N newest by
    (finish time, name), and every pinned run."""
    rule = policy.keep_last
    assert rule is not None
    keep: set[str] = set()
    for group in GROUPS:
        members = [o for o in objects if group_key(o) == group]
        pinned = {o["metadata"]["uid"] for o in members if o["metadata"]["annotations"]}
        keep |= pinned
        free = [o for o in members if o["metadata"]["uid"] not in pinned]
        buckets: list[tuple[list[dict[str, Any]], int | None]]
        if rule.total is not None:
            buckets = [(free, rule.total)]
        else:
            ok = [o for o in free if o["status"]["phase"] == "Succeeded"]
            bad = [o for o in free if o["status"]["phase"] != "Succeeded"]
            buckets = [(ok, rule.succeeded), (bad, rule.failed)]
        for bucket, limit in buckets:
            ranked = sorted(
                bucket,
                key=lambda o: (o["status"]["finishedAt"], o["metadata"]["name"]),
                reverse=True,
            )
            keep |= {o["metadata"]["uid"] for o in ranked[: limit if limit is not None else None]}
    return keep


def group_of(world: World, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The LIST by the group's label selector."""
    label = obj["metadata"]["labels"][CRON]
    return [dict(o) for o in world.objects.values() if o["metadata"]["labels"].get(CRON) == label]


def namespace_of(world: World, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The LIST a field group costs: every object of the namespace (fields are not
    selectable server-side)."""
    return [dict(o) for o in world.objects.values()]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_interleaving_keeps_exactly_the_newest_n(scenario: Scenario) -> None:
    interleave(scenario, group_of)


def interleave(
    scenario: Scenario, list_group: Callable[[World, Mapping[str, Any]], list[dict[str, Any]]]
) -> None:
    """Plays the scenario's steps in its order; `list_group` is the LIST a planner and a
    reaper make of a run's group."""
    objects, choices, policy = scenario
    policies = [policy]
    world = World()
    to_finish = list(objects)
    planners: list[Planner] = []
    reapers: list[Reaper] = []
    survivors = expected_survivors(objects, policy)

    def steps() -> list[Any]:
        return (
            [("finish", i) for i in range(len(to_finish))]
            + [("plan", p) for p in planners]
            + [("reap", r) for r in reapers if not r.done]
        )

    def advance(step: tuple[str, Any]) -> None:
        what, actor = step
        if what == "finish":
            obj = to_finish.pop(actor)
            world.objects[obj["metadata"]["uid"]] = obj
            planners.append(Planner(obj["metadata"]["uid"]))
        elif what == "plan" and actor.listed is None:
            actor.listed = list_group(
                world, world.objects.get(actor.uid) or objects_by_uid[actor.uid]
            )
        elif what == "plan":
            planners.remove(actor)
            for uid in counted_out(refs(actor.listed), policies, NOW):
                reapers.append(Reaper(uid))
        elif actor.read is None:
            actor.read = world.objects.get(actor.uid)
            if actor.read is None:
                actor.done = True  # already_gone
        elif actor.listed is None:
            actor.listed = list_group(world, actor.read)
        else:
            actor.done = True
            due = due_for(actor.read, NOW, policy="keep_last:nightly")
            verdict = classify(
                actor.read, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), actor.listed
            )
            current = world.objects.get(actor.uid)
            if isinstance(verdict, Delete) and current is not None:
                # The precondition: the version judged is the version deleted.
                assert current["metadata"]["resourceVersion"] == verdict.resource_version
                del world.objects[actor.uid]
                world.deleted.append(actor.uid)
        # After every step: no run the end state keeps has been deleted.
        assert not survivors & set(world.deleted)

    objects_by_uid = {o["metadata"]["uid"]: o for o in objects}
    for choice in choices:
        pending = steps()
        if not pending:
            break
        advance(pending[choice % len(pending)])
    while pending := steps():
        advance(pending[0])
    assert set(world.objects) == survivors
