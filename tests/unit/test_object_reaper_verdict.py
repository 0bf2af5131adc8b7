"""The object reaper's pure decision: `classify(fresh, due, kind, policies, safety, now)`.

Workflow objects are written the way Argo and KFP write them (status with the object,
the controller's labels); `argo_workflow` is shared with the integration tests.
"""

from __future__ import annotations

import copy
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.events.adapters import adapt_workflow
from lapse.events.kinds import ARGO_WORKFLOW, Gate
from lapse.events.models import CleanupDue, RunFinished
from lapse.events.run import Engine, RunRef, Target
from lapse.functions.object_reaper.gates import closed_gate
from lapse.functions.object_reaper.verdict import (
    AlreadyGone,
    Delete,
    GaveUp,
    Invalid,
    Kept,
    Replaced,
    Reschedule,
    Wait,
    classify,
)
from lapse.functions.policy import Policy
from lapse.functions.safety import NamespaceFilter, SafetyConfig, out_of_scope

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
TERMINAL = ("Succeeded", "Failed", "Error")
ARCHIVING = "workflows.argoproj.io/workflow-archiving-status"


def argo_workflow(
    name: str,
    *,
    namespace: str = "team-a",
    phase: str = "Succeeded",
    finished_at: datetime | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    ttl_strategy: dict[str, int] | None = None,
    archiving: str | None = None,
    kfp_run_id: str | None = None,
    kfp_persisted: bool = False,
) -> dict[str, Any]:
    """A Workflow body as the Argo controller (and KFP's API server) leave it."""
    done = phase in TERMINAL
    all_labels = {
        "workflows.argoproj.io/completed": "true" if done else "false",
        "workflows.argoproj.io/phase": phase,
        **(labels or {}),
    }
    if archiving is not None:
        all_labels[ARCHIVING] = archiving
    if kfp_run_id is not None:
        all_labels["pipeline/runid"] = kfp_run_id
        if kfp_persisted:
            all_labels["pipeline/persistedFinalState"] = "true"
    status: dict[str, Any] = {"phase": phase, "startedAt": "2026-11-21T09:00:00Z"}
    if done:
        status["finishedAt"] = (finished_at or NOW - timedelta(hours=1)).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
    spec: dict[str, Any] = {
        "entrypoint": "main",
        "templates": [{"name": "main", "container": {"image": "alpine"}}],
    }
    if ttl_strategy is not None:
        spec["ttlStrategy"] = ttl_strategy
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": all_labels,
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": status,
    }


def as_read(body: dict[str, Any], uid: str | None = None, rv: str = "41") -> dict[str, Any]:
    """The body as a GET returns it: with uid and resourceVersion."""
    read = copy.deepcopy(body)
    read["metadata"]["uid"] = uid or str(uuid.uuid4())
    read["metadata"]["resourceVersion"] = rv
    return read


def due_for(obj: dict[str, Any], deadline: datetime, policy: str = "test") -> CleanupDue:
    """The due event the planner would have scheduled for `obj` (as it was then)."""
    finished = adapt_workflow(obj)
    assert isinstance(finished, RunFinished)
    return CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=deadline,
        policy=policy,
        scheduled_at=deadline - timedelta(hours=1),
    )


def safety(**changes: Any) -> SafetyConfig:
    return SafetyConfig.model_validate(changes)


def expired(**kwargs: Any) -> tuple[dict[str, Any], CleanupDue]:
    """A Workflow whose 10-minute TTL ended 50 minutes ago, and its due event."""
    annotations = {"lapse.dev/ttl": "10m", **kwargs.pop("annotations", {})}
    obj = as_read(argo_workflow("wf", annotations=annotations, **kwargs))
    return obj, due_for(obj, NOW - timedelta(minutes=50))


def test_expired_workflow_is_deleted_with_its_resource_version() -> None:
    obj, due = expired()
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Delete)
    assert verdict.resource_version == "41"
    assert verdict.run.uid == obj["metadata"]["uid"]
    assert verdict.deadline == NOW - timedelta(minutes=50)
    assert verdict.policy == "annotation:lapse.dev/ttl"
    assert verdict.dry_run is False


def test_dry_run_is_a_flagged_delete() -> None:
    obj, due = expired()
    verdict = classify(obj, due, ARGO_WORKFLOW, (), safety(dry_run=True), NOW)
    assert isinstance(verdict, Delete) and verdict.dry_run


def test_gone() -> None:
    _, due = expired()
    assert isinstance(classify(None, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW), AlreadyGone)


def test_being_deleted_counts_as_gone() -> None:
    obj, due = expired()
    obj["metadata"]["deletionTimestamp"] = "2026-11-21T11:59:00Z"
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, AlreadyGone) and "already being deleted" in verdict.detail


def test_same_name_new_uid_is_replaced_and_never_deleted() -> None:
    _, due = expired()
    newer = as_read(argo_workflow("wf", annotations={"lapse.dev/ttl": "1s"}))
    verdict = classify(newer, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert verdict == Replaced(newer["metadata"]["uid"])


@pytest.mark.parametrize(
    "scope",
    [
        {"exclude": ["team-*"]},
        {"include": ["prod-*"]},
        {"include": ["*"], "exclude": ["kube-system", "team-a"]},
    ],
)
def test_out_of_scope_namespace_is_skipped_before_anything_else(scope: dict[str, Any]) -> None:
    # The scope is step 1, checked by the handler before any read (the integration test
    # counts the reads); here: the rule itself names the namespace it refuses.
    _, due = expired()
    reason = out_of_scope(due.run.namespace, safety(namespaces=scope).namespaces)
    assert reason is not None
    assert "team-a" in reason


def test_keep_annotation_added_after_scheduling_keeps() -> None:
    obj, due = expired(annotations={"lapse.dev/keep": "true"})
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Kept) and "lapse.dev/keep" in verdict.reason


def test_keep_wins_even_over_an_object_lapse_cannot_read() -> None:
    obj, due = expired(annotations={"lapse.dev/keep": "true"})
    obj["spec"]["ttlStrategy"] = {"secondsAfterCompletion": "soon"}
    assert isinstance(classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW), Kept)
    del obj["metadata"]["annotations"]["lapse.dev/keep"]
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Invalid) and "ttlStrategy" in verdict.reason


def test_rerun_workflow_is_not_touched() -> None:
    obj, due = expired()
    obj["status"] = {"phase": "Running", "startedAt": "2026-11-21T11:55:00Z"}
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Kept) and "Running" in verdict.reason


def test_policy_now_says_never() -> None:
    obj = as_read(argo_workflow("wf"))
    due = due_for(obj, NOW - timedelta(minutes=1))
    never = [Policy.model_validate({"name": "forever", "kubernetes": {"ttl": "never"}})]
    verdict = classify(obj, due, ARGO_WORKFLOW, never, SafetyConfig(), NOW)
    assert isinstance(verdict, Kept) and "never" in verdict.reason


def test_malformed_annotation_is_invalid_and_deletes_nothing() -> None:
    obj, due = expired(annotations={"lapse.dev/ttl": "3x"})
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Invalid) and "lapse.dev/ttl" in verdict.reason


def test_extended_ttl_reschedules_at_the_new_deadline() -> None:
    obj, due = expired(annotations={"lapse.dev/ttl": "2h"})
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Reschedule)
    assert verdict.deadline == NOW + timedelta(hours=1)  # finished 1 h ago + 2 h
    assert "moved" in verdict.reason


def test_early_due_event_is_rescheduled_not_acted_on() -> None:
    obj = as_read(argo_workflow("wf", annotations={"lapse.dev/ttl": "2h"}))
    due = due_for(obj, NOW + timedelta(hours=1))
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Reschedule)
    assert verdict.deadline == due.deadline
    assert "early" in verdict.reason


def test_later_deadline_that_has_passed_too_is_deleted() -> None:
    obj, due = expired(annotations={"lapse.dev/ttl": "30m"})  # was 10m; both are over
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Delete) and verdict.deadline == NOW - timedelta(minutes=30)


def test_argo_ttl_strategy_counts_from_the_fresh_object() -> None:
    obj = as_read(argo_workflow("wf", phase="Failed", ttl_strategy={"secondsAfterFailure": 7200}))
    due = due_for(obj, NOW - timedelta(minutes=50))
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Reschedule)
    assert verdict.policy == "argo:ttlStrategy.secondsAfterFailure"


def test_archiving_pending_waits() -> None:
    obj, due = expired(archiving="Pending")
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Wait)
    assert verdict.gate is Gate.ARGO_ARCHIVING
    assert verdict.retry_at == NOW + SafetyConfig().gate_retry.backoff
    assert verdict.deadline == due.deadline  # the wait does not move the deadline
    assert ARCHIVING in verdict.reason


@pytest.mark.parametrize(
    ("archiving", "wait"), [("Archived", True), (None, True), ("Pending", False)]
)
def test_archiving_gate_open(archiving: str | None, wait: bool) -> None:
    obj, due = expired(archiving=archiving)
    verdict = classify(obj, due, ARGO_WORKFLOW, (), safety(wait_for_archiving=wait), NOW)
    assert isinstance(verdict, Delete)


def test_kfp_run_without_persisted_final_state_waits() -> None:
    obj, due = expired(kfp_run_id="8c3e0d5e-run")
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Wait) and verdict.gate is Gate.KFP_PERSISTED
    assert "pipeline/persistedFinalState" in verdict.reason


@pytest.mark.parametrize(("persisted", "wait"), [(True, True), (False, False)])
def test_kfp_gate_open(persisted: bool, wait: bool) -> None:
    obj, due = expired(kfp_run_id="8c3e0d5e-run", kfp_persisted=persisted)
    verdict = classify(obj, due, ARGO_WORKFLOW, (), safety(wait_for_kfp_persisted=wait), NOW)
    assert isinstance(verdict, Delete)


def test_gate_wait_is_bounded() -> None:
    obj, due = expired(archiving="Pending")  # deadline 50 minutes ago
    settings_ = safety(gate_retry={"max_wait": "30m", "backoff": "10s"})
    verdict = classify(obj, due, ARGO_WORKFLOW, (), settings_, NOW)
    assert isinstance(verdict, GaveUp)
    assert verdict.gate is Gate.ARGO_ARCHIVING
    assert "argo-archiving" in verdict.reason and "nothing deleted" in verdict.reason
    still_waiting = safety(gate_retry={"max_wait": "1h", "backoff": "10s"})
    assert isinstance(classify(obj, due, ARGO_WORKFLOW, (), still_waiting, NOW), Wait)


def test_gates_do_not_apply_before_the_deadline() -> None:
    obj, due = expired(archiving="Pending", annotations={"lapse.dev/ttl": "2h"})
    assert isinstance(classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW), Reschedule)


def test_scope_filter_globs() -> None:
    everything = NamespaceFilter()
    assert out_of_scope("anything", everything) is None
    scoped = NamespaceFilter(include=("team-*", "ci"), exclude=("team-secret",))
    assert out_of_scope("team-a", scoped) is None
    assert out_of_scope("ci", scoped) is None
    assert "exclude" in (out_of_scope("team-secret", scoped) or "")
    assert "include" in (out_of_scope("prod", scoped) or "")


def labelled(labels: dict[str, str]) -> RunRef:
    return RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="team-a",
        name="wf",
        uid="u-1",
        phase="Succeeded",
        labels=labels,
    )


def test_closed_gate_prefers_archiving_and_names_the_label() -> None:
    labels = {ARCHIVING: "Pending", "pipeline/runid": "r1"}
    closed = closed_gate(labelled(labels), ARGO_WORKFLOW, SafetyConfig())
    assert closed is not None and closed.gate is Gate.ARGO_ARCHIVING
    persisted = {"pipeline/runid": "r1", "pipeline/persistedFinalState": "false"}
    assert closed_gate(labelled(persisted), ARGO_WORKFLOW, SafetyConfig())
    assert closed_gate(labelled({"pipeline/runid": ""}), ARGO_WORKFLOW, SafetyConfig()) is None


@settings(max_examples=400)
@given(
    finished_ago=st.integers(min_value=0, max_value=10 * 86400),
    ttl=st.integers(min_value=0, max_value=10 * 86400),
    due_shift=st.integers(min_value=-86400, max_value=86400),
    same_uid=st.booleans(),
    keep=st.booleans(),
    archiving=st.sampled_from([None, "Pending", "Archived"]),
    dry_run=st.booleans(),
)
def test_never_deletes_early_or_the_wrong_object(
    finished_ago: int,
    ttl: int,
    due_shift: int,
    same_uid: bool,
    keep: bool,
    archiving: str | None,
    dry_run: bool,
) -> None:
    finished = NOW - timedelta(seconds=finished_ago)
    annotations = {"lapse.dev/ttl": f"{ttl}s"}
    if keep:
        annotations["lapse.dev/keep"] = "true"
    then = as_read(argo_workflow("wf", finished_at=finished))
    due = due_for(then, NOW + timedelta(seconds=due_shift))
    fresh = copy.deepcopy(then)
    fresh["metadata"]["annotations"] = annotations
    fresh["metadata"]["resourceVersion"] = "42"
    if archiving:
        fresh["metadata"]["labels"][ARCHIVING] = archiving
    if not same_uid:
        fresh["metadata"]["uid"] = str(uuid.uuid4())

    verdict = classify(fresh, due, ARGO_WORKFLOW, (), safety(dry_run=dry_run), NOW)
    deadline = finished + timedelta(seconds=ttl)
    if isinstance(verdict, Delete):
        assert same_uid and not keep and archiving != "Pending"
        assert deadline <= NOW
        assert verdict.resource_version == "42"
        assert verdict.dry_run is dry_run
    if not same_uid:
        assert isinstance(verdict, Replaced)
    elif keep:
        assert isinstance(verdict, Kept)
    elif deadline > NOW:
        assert isinstance(verdict, Reschedule) and verdict.deadline == deadline


def test_a_run_without_finished_at_is_timed_from_when_it_was_first_seen() -> None:
    # The planner recorded when it first saw the run finished (the due event's run); the
    # object itself still has no finishedAt. Timed from `now`, the 5s TTL would move the
    # deadline on at every delivery and the run would never be deleted.
    body = argo_workflow("no-finish", annotations={"lapse.dev/ttl": "5s"})
    body["status"].pop("finishedAt", None)
    obj = as_read(body)
    first_seen = NOW - timedelta(seconds=6)
    adapted = adapt_workflow(obj)
    assert isinstance(adapted, RunFinished) and adapted.run.finished_at is None
    due = CleanupDue(
        run=adapted.run.model_copy(update={"finished_at": first_seen}),
        target=Target.KUBERNETES,
        deadline=first_seen + timedelta(seconds=5),
        policy="annotation:lapse.dev/ttl",
        scheduled_at=first_seen,
    )
    verdict = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), NOW)
    assert isinstance(verdict, Delete)
    assert verdict.deadline == first_seen + timedelta(seconds=5)
    # Before its time it is rescheduled for that same deadline, not for now + 5s.
    early = classify(obj, due, ARGO_WORKFLOW, (), SafetyConfig(), first_seen + timedelta(seconds=2))
    assert isinstance(early, Reschedule) and early.deadline == first_seen + timedelta(seconds=5)
