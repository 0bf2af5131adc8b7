"""The opt-in built-in kinds (RayJob, JobSet, SparkApplication) as their adapters read
them: finished or not, the finish time, the engine's own TTL by its controller's rule,
the owner, and malformed objects (refused, never guessed at)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from lapse.config.schema import LapseConfig
from lapse.events.adapters import Ignored, adapt_object
from lapse.events.adapters.objects import adapt
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import (
    BUILTIN_KINDS,
    DEFAULT_KINDS,
    JOBSET,
    RAYJOB,
    SPARK_APPLICATION,
    ByPhase,
    KindSpec,
    resolve_kinds,
)
from lapse.events.models import RunFinished
from lapse.events.run import RunRef, Target
from lapse.functions.policy import KubernetesClock, Policy, decide

NOW = datetime(2026, 3, 2, tzinfo=UTC)
ENDED = datetime(2026, 3, 1, 11, 0, tzinfo=UTC)


def owned_by(kind: str, name: str, *, controller: bool = True) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "x/v1", "kind": kind, "name": name, "uid": "o-1", "controller": controller}
    ]


def with_(obj: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """A deep copy with `spec`/`status`/`metadata` keys updated (None removes a key)."""
    result = copy.deepcopy(obj)
    for section, values in sections.items():
        for key, value in values.items():
            if value is None:
                result[section].pop(key, None)
            else:
                result[section][key] = value
    return result


def finished(obj: dict[str, Any], spec: KindSpec) -> RunRef:
    result = adapt(obj, spec)
    assert isinstance(result, RunFinished), result
    return result.run


RAY: dict[str, Any] = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": {"name": "tune", "namespace": "ml", "uid": "rj-1", "resourceVersion": "7"},
    "spec": {"entrypoint": "python tune.py", "ttlSecondsAfterFinished": 0},
    "status": {
        "jobStatus": "SUCCEEDED",
        "jobDeploymentStatus": "Complete",
        "startTime": "2026-03-01T10:00:00Z",
        "endTime": "2026-03-01T11:00:00Z",
        # The Ray job's own end (from the dashboard), not what KubeRay's TTL counts from.
        "rayJobInfo": {"endTime": "2026-03-01T10:59:00Z"},
    },
}


@pytest.mark.parametrize(("status", "phase"), [("Complete", "Succeeded"), ("Failed", "Failed")])
def test_a_rayjob_finishes_on_kuberays_terminal_deployment_status(status: str, phase: str) -> None:
    run = finished(with_(RAY, status={"jobDeploymentStatus": status}), RAYJOB)
    assert (run.kind, run.phase, run.finished_at) == ("RayJob", phase, ENDED)


@pytest.mark.parametrize(
    "status",
    ["", "Initializing", "Running", "ValidationFailed", "Suspending", "Suspended", "Retrying",
     "Waiting", "complete"],
)  # fmt: skip
def test_a_rayjob_in_any_other_deployment_status_has_not_finished(status: str) -> None:
    result = adapt(with_(RAY, status={"jobDeploymentStatus": status}), RAYJOB)
    assert isinstance(result, Ignored) and "not finished" in result.reason


@pytest.mark.parametrize(
    ("spec", "seconds"),
    [
        ({"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 300}, 300),
        # Absent is the CRD's default, 0: KubeRay acts at endTime.
        ({"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": None}, 0),
        # KubeRay ignores the TTL without shutdownAfterJobFinishes...
        ({"shutdownAfterJobFinishes": False, "ttlSecondsAfterFinished": 300}, None),
        ({"shutdownAfterJobFinishes": None, "ttlSecondsAfterFinished": 300}, None),
        # ...and for a RayJob on an existing cluster, which it never cleans up.
        (
            {
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": 300,
                "clusterSelector": {"ray.io/cluster": "shared"},
            },
            None,
        ),
    ],
)
def test_a_rayjobs_ttl_counts_by_kuberays_rule(spec: dict[str, Any], seconds: int | None) -> None:
    run = finished(with_(RAY, spec=spec), RAYJOB)
    decision = decide(run, Target.KUBERNETES, [], NOW)
    if seconds is None:
        assert run.ttl_strategy is None and decision.policy == "default"
        return
    assert decision.policy == "rayjob:spec.ttlSecondsAfterFinished"
    assert decision.reason.startswith(f"spec.ttlSecondsAfterFinished={seconds}")
    assert decision.deadline == ENDED + timedelta(seconds=seconds)  # from status.endTime


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("spec", {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": "60"}, "integer"),
        ("spec", {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": -1}, "0"),
        ("spec", {"shutdownAfterJobFinishes": "true"}, "must be a boolean"),
        ("spec", {"shutdownAfterJobFinishes": True, "clusterSelector": ["a"]}, "clusterSelector"),
        ("status", {"endTime": "yesterday"}, "status.endTime"),
        ("status", {"jobDeploymentStatus": 3}, "must be a string"),
    ],
)
def test_a_malformed_rayjob_is_refused(section: str, values: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidEvent, match=message):
        adapt(with_(RAY, **{section: values}), RAYJOB)


def test_a_controlled_rayjob_is_left_to_its_owner_and_kueue_owns_none() -> None:
    owned = with_(RAY, metadata={"ownerReferences": owned_by("FlyteWorkflow", "wf")})
    result = adapt(owned, RAYJOB)
    assert isinstance(result, Ignored) and "FlyteWorkflow/wf" in result.reason
    # A plain owner reference (no controller) decides nothing.
    loose = with_(RAY, metadata={"ownerReferences": owned_by("Team", "a", controller=False)})
    assert isinstance(adapt(loose, RAYJOB), RunFinished)


def test_a_policys_per_phase_clock_applies_to_a_mapped_phase() -> None:
    """KubeRay says Complete, Spark COMPLETED: lapse reads them as Succeeded, so a policy's
    after_success applies (the engine's own word would match no clock)."""
    policy = Policy(name="ml", kubernetes=KubernetesClock(after_success="2h", after_failure="7d"))
    done = decide(finished(RAY, RAYJOB), Target.KUBERNETES, [policy], NOW)
    assert done.deadline == ENDED + timedelta(hours=2)
    failed = finished(
        with_(SPARK, status={"applicationState": {"state": "FAILED"}}), SPARK_APPLICATION
    )
    assert decide(failed, Target.KUBERNETES, [policy], NOW).deadline == ENDED + timedelta(days=7)


JOBSET_OBJ: dict[str, Any] = {
    "apiVersion": "jobset.x-k8s.io/v1alpha2",
    "kind": "JobSet",
    "metadata": {"name": "pretrain", "namespace": "ml", "uid": "js-1", "resourceVersion": "9"},
    "spec": {"replicatedJobs": []},
    "status": {
        "restarts": 0,
        "terminalState": "Completed",
        "conditions": [
            {
                "type": "StartupPolicyCompleted",
                "status": "True",
                "lastTransitionTime": "2026-03-01T10:00:00Z",
            },
            {"type": "Completed", "status": "True", "lastTransitionTime": "2026-03-01T11:00:00Z"},
        ],
    },
}


def jobset_condition(kind: str, status: str = "True") -> dict[str, Any]:
    return with_(
        JOBSET_OBJ,
        status={
            "conditions": [
                {"type": kind, "status": status, "lastTransitionTime": "2026-03-01T11:00:00Z"}
            ]
        },
    )


@pytest.mark.parametrize(("condition", "phase"), [("Completed", "Succeeded"), ("Failed", "Failed")])
def test_a_jobset_finishes_on_completed_or_failed_at_that_conditions_time(
    condition: str, phase: str
) -> None:
    run = finished(jobset_condition(condition), JOBSET)
    assert (run.phase, run.finished_at) == (phase, ENDED)


@pytest.mark.parametrize(
    ("condition", "status"),
    [("Completed", "False"), ("Failed", "Unknown"), ("Suspended", "True"),
     ("StartupPolicyCompleted", "True")],
)  # fmt: skip
def test_a_jobset_without_a_true_terminal_condition_has_not_finished(
    condition: str, status: str
) -> None:
    assert isinstance(adapt(jobset_condition(condition, status), JOBSET), Ignored)


def test_a_jobsets_own_ttl_counts_from_the_condition() -> None:
    run = finished(with_(JOBSET_OBJ, spec={"ttlSecondsAfterFinished": 120}), JOBSET)
    decision = decide(run, Target.KUBERNETES, [], NOW)
    assert decision.policy == "jobset:spec.ttlSecondsAfterFinished"
    assert decision.deadline == ENDED + timedelta(seconds=120)
    # Unset: the JobSet controller never deletes it; lapse's policies and default decide.
    assert decide(finished(JOBSET_OBJ, JOBSET), Target.KUBERNETES, [], NOW).policy == "default"


def test_a_trainjobs_jobset_is_left_to_the_trainjob() -> None:
    owned = with_(JOBSET_OBJ, metadata={"ownerReferences": owned_by("TrainJob", "llama")})
    result = adapt(owned, JOBSET)
    assert isinstance(result, Ignored) and "TrainJob/llama" in result.reason


@pytest.mark.parametrize(
    "conditions",
    [
        [{"type": "Completed", "status": True, "lastTransitionTime": "2026-03-01T11:00:00Z"}],
        [{"type": "Completed", "status": "True", "lastTransitionTime": "11:00"}],
        "Completed",
    ],
)
def test_a_malformed_jobset_is_refused(conditions: Any) -> None:
    with pytest.raises(InvalidEvent):
        adapt(with_(JOBSET_OBJ, status={"conditions": conditions}), JOBSET)


SPARK: dict[str, Any] = {
    "apiVersion": "sparkoperator.k8s.io/v1beta2",
    "kind": "SparkApplication",
    "metadata": {"name": "etl", "namespace": "data", "uid": "sa-1", "resourceVersion": "4"},
    "spec": {"type": "Scala", "mode": "cluster"},
    "status": {
        "applicationState": {"state": "COMPLETED"},
        "lastSubmissionAttemptTime": "2026-03-01T10:00:00Z",
        "terminationTime": "2026-03-01T11:00:00Z",
        "driverInfo": {},
    },
}


@pytest.mark.parametrize(("state", "phase"), [("COMPLETED", "Succeeded"), ("FAILED", "Failed")])
def test_a_sparkapplication_finishes_on_the_operators_terminal_states(
    state: str, phase: str
) -> None:
    run = finished(with_(SPARK, status={"applicationState": {"state": state}}), SPARK_APPLICATION)
    assert (run.phase, run.finished_at) == (phase, ENDED)


@pytest.mark.parametrize(
    "state",
    ["", "SUBMITTED", "RUNNING", "SUBMISSION_FAILED", "PENDING_RERUN", "INVALIDATING",
     "SUCCEEDING", "FAILING", "SUSPENDING", "SUSPENDED", "RESUMING", "UNKNOWN"],
)  # fmt: skip
def test_a_sparkapplication_in_any_other_state_has_not_finished(state: str) -> None:
    result = adapt(with_(SPARK, status={"applicationState": {"state": state}}), SPARK_APPLICATION)
    assert isinstance(result, Ignored) and f"is {state or 'not started'}" in result.reason


def test_a_sparkapplications_time_to_live_counts_from_its_termination_time() -> None:
    run = finished(with_(SPARK, spec={"timeToLiveSeconds": 3600}), SPARK_APPLICATION)
    decision = decide(run, Target.KUBERNETES, [], NOW)
    assert decision.policy == "sparkapplication:spec.timeToLiveSeconds"
    assert decision.reason.startswith("spec.timeToLiveSeconds=3600")
    assert decision.deadline == ENDED + timedelta(hours=1)


def test_a_scheduled_sparkapplications_run_is_not_controlled_and_a_controlled_one_is_left() -> None:
    # The operator's ScheduledSparkApplication sets an owner reference without controller.
    scheduled = with_(
        SPARK,
        metadata={"ownerReferences": owned_by("ScheduledSparkApplication", "n", controller=False)},
    )
    assert isinstance(adapt(scheduled, SPARK_APPLICATION), RunFinished)
    controlled = with_(SPARK, metadata={"ownerReferences": owned_by("Pipeline", "p")})
    assert isinstance(adapt(controlled, SPARK_APPLICATION), Ignored)


@pytest.mark.parametrize(
    ("section", "values"),
    [
        ("spec", {"timeToLiveSeconds": 1.5}),
        ("spec", {"timeToLiveSeconds": True}),
        ("spec", {"timeToLiveSeconds": -5}),
        ("status", {"terminationTime": 1700000000}),
        ("status", {"applicationState": "COMPLETED"}),
    ],
)
def test_a_malformed_sparkapplication_is_refused(section: str, values: dict[str, Any]) -> None:
    with pytest.raises(InvalidEvent):
        adapt(with_(SPARK, **{section: values}), SPARK_APPLICATION)


def test_a_null_termination_time_is_no_finish_time() -> None:
    # metav1.Time without omitempty-pointer: the operator may write null.
    run = finished(with_(SPARK, status={"terminationTime": None}), SPARK_APPLICATION)
    assert run.finished_at is None


def test_the_opt_in_kinds_are_built_in_but_not_in_the_default_list() -> None:
    opt_in = {"rayjob", "jobset", "sparkapplication"}
    assert opt_in <= set(BUILTIN_KINDS)
    assert not opt_in & set(DEFAULT_KINDS.names())
    assert set(LapseConfig().kinds.names()) == set(DEFAULT_KINDS.names())
    chosen = LapseConfig.model_validate({"kinds": ["job", "rayjob", "jobset", "sparkapplication"]})
    assert chosen.kinds.of("ray.io/v1", "RayJob") is RAYJOB
    assert resolve_kinds(["sparkapplication"]).names() == ["sparkapplication"]
    with pytest.raises(InvalidEvent, match="not a kind lapse is configured for"):
        adapt_object(RAY)  # the default kinds


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"succeeded": ("DONE", "OOPS")}, "not in phases: OOPS"),
        ({"succeeded": ("DONE",), "failed": ("DONE",)}, "both succeeded and failed"),
    ],
)
def test_a_phase_mapping_names_only_finished_phases(mapping: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ByPhase(field="status.state", phases=("DONE", "ERROR"), **mapping)
