"""Floors hold: a ClusterLapsePolicy's Kubernetes `minTTL` bounds a LapsePolicy's
`keepLast` as it bounds its TTLs (functions/policy_objects.py, functions/policy.py:
`count_deadline`). A run counted out of a LapsePolicy's group is due no earlier than its
own finish plus the minimum, in the planner's decision and in the reaper's recount.

The finding (issue 36): minTTL 1h, a LapsePolicy `ttl: 1m` with `keepLast: {total: 1}`:
the status said the TTL was clamped to 1h, and the older run of the group was deleted
3 s after it finished."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.events.kinds import ARGO_WORKFLOW
from lapse.events.run import RunRef, Target
from lapse.functions.durations import parse_ttl
from lapse.functions.object_reaper.verdict import Delete, Reschedule, classify, counts
from lapse.functions.policy import (
    Action,
    Decision,
    Policy,
    counted_out,
    decide,
    with_count,
)
from lapse.functions.policy_objects import effective
from lapse.functions.safety import SafetyConfig
from tests.unit.test_keep_last import CRON, NOW, refs, run
from tests.unit.test_object_reaper_verdict import due_for
from tests.unit.test_policy_objects import cluster_policy, lapse_policy

HOUR = timedelta(hours=1)


def floor_of(minimum: str, name: str = "platform") -> Any:
    return cluster_policy(name, {
        "match": {"namespaces": ["team-*"]},
        "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": minimum}},
    })  # fmt: skip


FINDING = lapse_policy("p", "team-a", {"kubernetes": {"ttl": "1m"}, "keepLast": {"total": 1}})
COUNT_ONLY = lapse_policy("p", "team-a", {"keepLast": {"total": 1}})


def decisions(objects: list[dict[str, Any]], policies: tuple[Policy, ...]) -> dict[str, Decision]:
    """What the planner decides for each listed run of a group: its clocks, then the count."""
    listed = refs(objects)
    counted = counted_out(listed, policies, NOW)
    return {
        r.name: with_count(decide(r, Target.KUBERNETES, policies, NOW), counted.get(r.uid))
        for r in listed
    }


def finished(obj: dict[str, Any]) -> Any:
    found = refs([obj])[0].finished_at
    assert found is not None
    return found


def test_the_findings_older_run_stays_the_minimum_after_it_finished() -> None:
    found = effective([FINDING], [floor_of("1h")])
    verdict = found.verdicts[0]
    assert (verdict.accepted, verdict.reason) == (True, "Clamped")
    assert "kubernetes.ttl 1m clamped to the minimum 1h (clusterlapsepolicy:platform@1)" in (
        verdict.message
    )
    assert (
        "keepLast: a run it counts out is kept at least the minimum 1h after it finished "
        "(clusterlapsepolicy:platform@1)" in verdict.message
    )
    old, new = run("old", 2), run("new", 1)
    planned = decisions([old, new], found.policies)
    assert planned["old"].deadline == finished(old) + HOUR
    assert planned["new"].deadline == finished(new) + HOUR


def test_a_count_alone_is_due_at_the_floor_and_says_so() -> None:
    found = effective([COUNT_ONLY], [floor_of("1h")])
    assert found.verdicts[0].reason == "Clamped"
    old, new = run("old", 2), run("new", 1)
    decision = decisions([old, new], found.policies)["old"]
    assert decision.policy == "keep_last:lapsepolicy:team-a/p@1"
    assert decision.deadline == finished(old) + HOUR  # not when "new" finished
    assert "kept at least the minimum 1h (clusterlapsepolicy:platform@1)" in decision.reason
    # The newest is not counted out: its clock (the built-in 24h) decides.
    assert decisions([old, new], found.policies)["new"].policy == "default"


def test_a_run_pushed_out_after_the_floor_is_due_when_it_was_pushed_out() -> None:
    found = effective([COUNT_ONLY], [floor_of("1h")])
    old, new = run("old", 180), run("new", 30)
    decision = decisions([old, new], found.policies)["old"]
    assert decision.deadline == finished(new)
    assert "kept at least" not in decision.reason


def test_the_tightest_floor_of_the_covering_cluster_policies_holds_and_is_named() -> None:
    capped = cluster_policy("capped", {
        "match": {"namespaces": ["team-*"]},
        "namespacedPolicies": {"allowed": True, "kubernetes": {"maxTTL": "30d"}},
    })  # fmt: skip
    found = effective([COUNT_ONLY], [floor_of("1h", "a"), floor_of("3h", "b"), capped])
    old, new = run("old", 2), run("new", 1)
    decision = decisions([old, new], found.policies)["old"]
    assert decision.deadline == finished(old) + 3 * HOUR
    assert "kept at least the minimum 3h (clusterlapsepolicy:b@1)" in decision.reason
    # Only the policy whose minimum holds is named: not "a" (a lower one), not "capped".
    assert found.verdicts[0].message.endswith("the minimum 3h after it finished "
                                              "(clusterlapsepolicy:b@1)")  # fmt: skip


def test_the_operators_own_counts_have_no_floor() -> None:
    # lapse.yaml's and a ClusterLapsePolicy's own keepLast are the platform's word, not a
    # tenant's: the bounds on namespaced policies do not reach them (docs/policies.md).
    configured = Policy.model_validate({"name": "ops", "keep_last": {"total": 1}})
    own = cluster_policy("ops", {"match": {"namespaces": ["team-*"]}, "keepLast": {"total": 1}})
    old, new = run("old", 2), run("new", 1)
    for found in (
        effective([], [floor_of("1h")], (configured,)),
        effective([], [floor_of("1h"), own]),
    ):
        assert decisions([old, new], found.policies)["old"].deadline == finished(new)


def test_a_policy_without_keep_last_says_nothing_about_it() -> None:
    found = effective([lapse_policy("p", "team-a", {"kubernetes": {"ttl": "2h"}})],
                      [floor_of("1h")])  # fmt: skip
    assert (found.verdicts[0].reason, found.verdicts[0].message) == (
        "Accepted", "in effect for namespace team-a",
    )  # fmt: skip


def test_the_reaper_holds_the_floor_on_a_schedule_put_without_it() -> None:
    # A schedule at the moment the newer run finished (a count made before the floor: an
    # older lapse, or a bound set since): the reaper's recount does not delete on it.
    policies = effective([COUNT_ONLY], [floor_of("1h")]).policies
    old, new = run("old", 2), run("new", 1)
    due = due_for(old, finished(new), policy="keep_last:lapsepolicy:team-a/p@1")
    first = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW)
    assert isinstance(first, Reschedule)  # its clock (24h) says not yet: it counts
    assert counts(first, policies) == f"{CRON}=etl"
    recount = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), [old, new])
    assert isinstance(recount, Reschedule), recount
    assert recount.deadline == finished(old) + HOUR
    assert recount.policy == "keep_last:lapsepolicy:team-a/p@1"
    later = finished(old) + HOUR
    at_floor = classify(old, due, ARGO_WORKFLOW, policies, SafetyConfig(), later, (), [old, new])
    assert isinstance(at_floor, Delete) and at_floor.deadline == finished(old) + HOUR


# --- for any policies and bounds, no deadline comes before the floor ----------------------

MINIMUMS = ("1m", "30m", "1h", "6h", "23h")  # under the built-in 24h: nothing else is earlier
TTLS = ("1m", "5m", "1h", "12h", "2d", "never")


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[Any], list[Any], list[dict[str, Any]], timedelta]:
    minimums = draw(st.lists(st.sampled_from(MINIMUMS), min_size=1, max_size=2))
    clusters = [floor_of(m, f"c{i}") for i, m in enumerate(minimums)]
    namespaced = []
    for i in range(draw(st.integers(1, 3))):
        spec: dict[str, Any] = {}
        clock = draw(st.sampled_from(("ttl", "afterSuccess", "afterFailure", None)))
        if clock is not None:
            spec["kubernetes"] = {clock: draw(st.sampled_from(TTLS))}
        counts = draw(st.sampled_from(({"total": 1}, {"total": 0}, {"succeeded": 2, "failed": 0},
                                       {"failed": 1})))  # fmt: skip
        if clock is None or draw(st.booleans()):
            spec["keepLast"] = counts
        if draw(st.booleans()):
            spec["match"] = {"labels": {CRON: draw(st.sampled_from(("etl", "other")))}}
        namespaced.append(lapse_policy(f"p{i}", "team-a", spec))
    objects = [
        run(
            f"r{i}",
            draw(st.integers(0, 26 * 60)),
            phase=draw(st.sampled_from(("Succeeded", "Failed", "Error"))),
            group=draw(st.sampled_from(("etl", "other"))),
        )
        for i in range(draw(st.integers(1, 8)))
    ]
    floor = max(parse_ttl(m) for m in minimums)
    assert isinstance(floor, timedelta)
    return namespaced, clusters, objects, floor


@settings(max_examples=150, deadline=None)
@given(worlds())
def test_no_deadline_comes_before_the_floor(
    world: tuple[list[Any], list[Any], list[dict[str, Any]], timedelta],
) -> None:
    namespaced, clusters, objects, floor = world
    policies = effective(namespaced, clusters).policies
    listed: list[RunRef] = refs(objects)
    for name, decision in decisions(objects, policies).items():
        ref = next(r for r in listed if r.name == name)
        assert ref.finished_at is not None
        if decision.action is Action.SCHEDULE:
            assert decision.deadline is not None
            assert decision.deadline >= ref.finished_at + floor, decision
    for obj in objects:
        # The reaper, handed any schedule for the run and the group as listed now, never
        # deletes before the floor either.
        due = due_for(obj, NOW - timedelta(days=1))
        ends = finished(obj) + floor
        for verdict in (
            classify(obj, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW),
            classify(obj, due, ARGO_WORKFLOW, policies, SafetyConfig(), NOW, (), objects),
        ):
            if isinstance(verdict, Delete):
                assert ends <= NOW, verdict
            if isinstance(verdict, Reschedule):
                assert verdict.deadline >= ends, verdict


def test_a_field_group_holds_the_floor_too() -> None:
    by_template = lapse_policy("p", "team-a", {
        "keepLast": {"groupBy": "field:spec.workflowTemplateRef.name", "total": 1},
    })  # fmt: skip
    found = effective([by_template], [floor_of("1h")])
    old, new = run("old", 2, by="field"), run("new", 1, by="field")
    decision = decisions([old, new], found.policies)["old"]
    assert decision.policy == "keep_last:lapsepolicy:team-a/p@1"
    assert decision.deadline == finished(old) + HOUR
