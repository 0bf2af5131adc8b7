"""Engine adapters, fed with objects and events shaped the way Argo, KFP, Tekton, Kubernetes
and Knative really produce them, and with broken ones."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.events import EventType, InvalidEvent, build_event
from lapse.events.adapters import (
    Ignored,
    NeedsFetch,
    adapt_cloudevent,
    adapt_job,
    adapt_kubernetes_event,
    adapt_object,
    adapt_pipelinerun,
    adapt_tekton_event,
    adapt_workflow,
)
from lapse.events.kinds import KindSet, KindSpec, resolve_kinds
from lapse.events.models import RunDeleted, RunFinished
from lapse.events.run import ArgoTTLStrategy, Engine, Target
from lapse.functions.policy import decide

# An Argo Workflow created by Kubeflow Pipelines v2, as GET /apis/argoproj.io/v1alpha1/...
# returns it after the controller marked it Succeeded (node statuses trimmed).
KFP_WORKFLOW: dict[str, Any] = {
    "apiVersion": "argoproj.io/v1alpha1",
    "kind": "Workflow",
    "metadata": {
        "annotations": {
            "pipelines.kubeflow.org/components-comp-train": '{"executorLabel":"exec-train"}',
            "pipelines.kubeflow.org/kfp_sdk_version": "2.14.3",
            "pipelines.kubeflow.org/pipeline_compilation_time": "2026-02-28T09:12:44.123456",
            "workflows.argoproj.io/pod-name-format": "v2",
        },
        "creationTimestamp": "2026-03-01T11:52:10Z",
        "generateName": "train-pipeline-",
        "generation": 9,
        "labels": {
            "pipeline/persistedFinalState": "true",
            "pipeline/runid": "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00",
            "pipelines.kubeflow.org/v2_component": "true",
            "workflows.argoproj.io/completed": "true",
            "workflows.argoproj.io/phase": "Succeeded",
        },
        "name": "train-pipeline-7xk2p",
        "namespace": "kubeflow-user-example-com",
        "resourceVersion": "184467",
        "uid": "5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11",
    },
    "spec": {
        "arguments": {},
        "entrypoint": "entrypoint",
        "podMetadata": {"labels": {"pipeline/runid": "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00"}},
        "serviceAccountName": "default-editor",
        "templates": [{"name": "entrypoint", "dag": {"tasks": []}}],
        "ttlStrategy": {"secondsAfterCompletion": 3600},
    },
    "status": {
        "artifactGCStatus": {"notSpecified": True},
        "artifactRepositoryRef": {"default": True, "artifactRepository": {}},
        "conditions": [
            {"status": "False", "type": "PodRunning"},
            {"status": "True", "type": "Completed"},
        ],
        "finishedAt": "2026-03-01T12:00:00Z",
        "nodes": {
            "train-pipeline-7xk2p": {
                "id": "train-pipeline-7xk2p",
                "name": "train-pipeline-7xk2p",
                "phase": "Succeeded",
                "type": "DAG",
                "startedAt": "2026-03-01T11:52:10Z",
                "finishedAt": "2026-03-01T12:00:00Z",
            }
        },
        "phase": "Succeeded",
        "progress": "3/3",
        "resourcesDuration": {"cpu": 41, "memory": 2210},
        "startedAt": "2026-03-01T11:52:10Z",
        "taskResultsCompletionStatus": {"train-pipeline-7xk2p-1234": True},
    },
}

# A v1 PipelineRun as the Tekton controller puts it in its CloudEvents: converted to
# v1beta1 and without TypeMeta (hence the odd `/apis///namespaces/...` source).
TEKTON_PIPELINERUN: dict[str, Any] = {
    "metadata": {
        "name": "build-and-test-r8v2q",
        "namespace": "ci",
        "uid": "8f5bb1d4-2a52-4f0c-8d0a-6f0f7f1c0b3e",
        "resourceVersion": "90211",
        "generation": 1,
        "creationTimestamp": "2026-03-01T11:58:01Z",
        "labels": {
            "tekton.dev/pipeline": "build-and-test",
            "triggers.tekton.dev/eventlistener": "github",
        },
        "annotations": {"lapse.dev/ttl": "2h"},
    },
    "spec": {
        "pipelineRef": {"name": "build-and-test"},
        "serviceAccountName": "default",
        "timeouts": {"pipeline": "1h0m0s"},
    },
    "status": {
        "conditions": [
            {
                "type": "Succeeded",
                "status": "True",
                "lastTransitionTime": "2026-03-01T12:04:31Z",
                "reason": "Succeeded",
                "message": "Tasks Completed: 2 (Failed: 0, Cancelled 0), Skipped: 0",
            }
        ],
        "startTime": "2026-03-01T11:58:01Z",
        "completionTime": "2026-03-01T12:04:30Z",
        "childReferences": [
            {
                "apiVersion": "tekton.dev/v1",
                "kind": "TaskRun",
                "name": "build-and-test-r8v2q-build",
                "pipelineTaskName": "build",
            }
        ],
    },
}

# A batch/v1 Job after success, created without labels of its own, as the Job controller of
# Kubernetes v1.35 leaves it (tests/fixtures/engines/, recorded on the test cluster):
# SuccessCriteriaMet, then Complete. (A CronJob's Job is controlled by it: see
# test_job_of_a_cronjob_is_left_to_it.)
JOB: dict[str, Any] = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {
        "name": "nightly-report-29000000",
        "namespace": "reports",
        "uid": "c2a0d5de-3f5b-4c1f-9a9b-0d4f6a7e8b91",
        "resourceVersion": "77120",
        "labels": {
            "batch.kubernetes.io/controller-uid": "c2a0d5de-3f5b-4c1f-9a9b-0d4f6a7e8b91",
            "batch.kubernetes.io/job-name": "nightly-report-29000000",
            "controller-uid": "c2a0d5de-3f5b-4c1f-9a9b-0d4f6a7e8b91",
            "job-name": "nightly-report-29000000",
        },
    },
    "spec": {"backoffLimit": 6, "completions": 1, "parallelism": 1, "template": {}},
    "status": {
        "conditions": [
            {
                "type": "SuccessCriteriaMet",
                "status": "True",
                "reason": "CompletionsReached",
                "message": "Reached expected number of succeeded pods",
                "lastProbeTime": "2026-03-01T12:00:05Z",
                "lastTransitionTime": "2026-03-01T12:00:05Z",
            },
            {
                "type": "Complete",
                "status": "True",
                "reason": "CompletionsReached",
                "message": "Reached expected number of succeeded pods",
                "lastProbeTime": "2026-03-01T12:00:06Z",
                "lastTransitionTime": "2026-03-01T12:00:06Z",
            },
        ],
        "startTime": "2026-03-01T11:59:00Z",
        "completionTime": "2026-03-01T12:00:06Z",
        "succeeded": 1,
        "ready": 0,
        "terminating": 0,
        "uncountedTerminatedPods": {},
    },
}

# The Kubernetes Event the Argo controller records when a Workflow succeeds.
ARGO_K8S_EVENT: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Event",
    "metadata": {
        "name": "train-pipeline-7xk2p.182a4b1c9d0e7f31",
        "namespace": "kubeflow-user-example-com",
        "uid": "e1a1f0c2-0d7b-4b4e-9a9f-1f2e3d4c5b6a",
        "resourceVersion": "184470",
        "creationTimestamp": "2026-03-01T12:00:00Z",
    },
    "involvedObject": {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "name": "train-pipeline-7xk2p",
        "namespace": "kubeflow-user-example-com",
        "uid": "5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11",
        "resourceVersion": "184466",
    },
    "reason": "WorkflowSucceeded",
    "message": "Workflow completed",
    "source": {"component": "workflow-controller"},
    "firstTimestamp": "2026-03-01T12:00:00Z",
    "lastTimestamp": "2026-03-01T12:00:00Z",
    "count": 1,
    "type": "Normal",
    "eventTime": None,
    "reportingComponent": "workflow-controller",
    "reportingInstance": "",
}


def changed(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy with the dotted `path` set to `value` (or removed if value is DELETE)."""
    result = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node = result
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    index: Any = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[index]
    else:
        node[index] = value
    return result


DELETE = object()


def cloudevent(event_type: str, data: Any, **attributes: Any) -> CloudEvent:
    return CloudEvent(
        {
            "type": event_type,
            "source": "https://10.96.0.1:443",
            "id": "f2d9c1a0-7c8e-4d0b-8a5e-2b1c0d9e8f7a",
            "datacontenttype": "application/json",
            **attributes,
        },
        data,
    )


# --- Argo ----------------------------------------------------------------------------------


def test_kfp_workflow_becomes_run_finished() -> None:
    result = adapt_workflow(KFP_WORKFLOW)
    assert isinstance(result, RunFinished)
    run = result.run
    assert run.engine is Engine.ARGO
    assert (run.api_version, run.kind) == ("argoproj.io/v1alpha1", "Workflow")
    assert run.subject == "kubeflow-user-example-com/train-pipeline-7xk2p"
    assert run.uid == "5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11"
    assert run.resource_version == "184467"
    assert run.phase == "Succeeded"
    assert run.finished_at == datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert run.kfp_run_id == "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00"
    assert run.ttl_strategy == ArgoTTLStrategy(seconds_after_completion=3600)
    assert run.labels["pipeline/persistedFinalState"] == "true"
    assert run.annotations["pipelines.kubeflow.org/kfp_sdk_version"] == "2.14.3"


@pytest.mark.parametrize("phase", ["Failed", "Error"])
def test_failed_and_errored_workflows_are_finished(phase: str) -> None:
    result = adapt_workflow(changed(KFP_WORKFLOW, "status.phase", phase))
    assert isinstance(result, RunFinished)
    assert result.run.phase == phase


@pytest.mark.parametrize("phase", ["", "Pending", "Running"])
def test_unfinished_workflows_are_ignored(phase: str) -> None:
    running = changed(changed(KFP_WORKFLOW, "status.phase", phase), "status.finishedAt", None)
    result = adapt_workflow(running)
    assert isinstance(result, Ignored)
    assert "train-pipeline-7xk2p" in result.reason


def test_workflow_without_status_is_ignored() -> None:
    assert isinstance(adapt_workflow(changed(KFP_WORKFLOW, "status", DELETE)), Ignored)


def test_deleted_workflow_is_run_deleted_whatever_its_phase() -> None:
    running = changed(KFP_WORKFLOW, "status.phase", "Running")
    result = adapt_workflow(running, deleted=True)
    assert isinstance(result, RunDeleted)
    assert result.run.phase == "Running"
    assert result.run.uid == KFP_WORKFLOW["metadata"]["uid"]


def test_workflow_without_kfp_label_or_ttl() -> None:
    plain = changed(changed(KFP_WORKFLOW, "metadata.labels", None), "spec.ttlStrategy", DELETE)
    result = adapt_workflow(plain)
    assert isinstance(result, RunFinished)
    assert result.run.kfp_run_id is None
    assert result.run.ttl_strategy is None
    assert result.run.labels == {}


def test_workflow_items_of_a_list_need_no_type_meta() -> None:
    item = changed(changed(KFP_WORKFLOW, "apiVersion", DELETE), "kind", DELETE)
    result = adapt_workflow(item)
    assert isinstance(result, RunFinished)
    assert result.run.api_version == "argoproj.io/v1alpha1"


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("metadata.uid", DELETE, "metadata.uid is missing"),
        ("metadata.uid", "", "metadata.uid is missing"),
        ("metadata.name", DELETE, "metadata.name is missing"),
        ("metadata.namespace", DELETE, "metadata.namespace is missing"),
        ("metadata", "oops", "metadata must be a JSON object, not string"),
        ("metadata.labels", ["a"], "metadata.labels must be a JSON object, not list"),
        ("metadata.labels.count", 3, "metadata.labels values must all be strings"),
        ("status.finishedAt", "yesterday", "status.finishedAt: not an RFC 3339"),
        ("status.finishedAt", "2026-03-01T12:00:00", "status.finishedAt: not an RFC 3339"),
        ("status.finishedAt", "2026-13-01T12:00:00Z", "status.finishedAt"),
        ("status.finishedAt", 1700000000, "status.finishedAt must be a string, not number"),
        ("status.phase", ["Succeeded"], "status.phase must be a string, not list"),
        ("status", [], "status must be a JSON object"),
        ("spec.ttlStrategy", 3600, "spec.ttlStrategy must be a JSON object"),
        ("spec.ttlStrategy.secondsAfterCompletion", "1h", "must be an integer, not string"),
        ("spec.ttlStrategy.secondsAfterCompletion", True, "must be an integer, not boolean"),
        ("spec.ttlStrategy.secondsAfterCompletion", -1, "greater than or equal to 0"),
        ("kind", "CronWorkflow", "expected argoproj.io Workflow, got"),
        ("apiVersion", "tekton.dev/v1", "expected argoproj.io Workflow"),
    ],
)
def test_malformed_workflows_are_invalid(path: str, value: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        adapt_workflow(changed(KFP_WORKFLOW, path, value))


@pytest.mark.parametrize("obj", [None, [], "Workflow", 42])
def test_non_objects_are_invalid(obj: Any) -> None:
    with pytest.raises(InvalidEvent, match="must be a JSON object"):
        adapt_workflow(obj)
    with pytest.raises(InvalidEvent, match="must be a JSON object"):
        adapt_object(obj)


# --- Tekton --------------------------------------------------------------------------------


def tekton_event(event_type: str, pipeline_run: Any) -> CloudEvent:
    return cloudevent(
        event_type,
        {"pipelineRun": pipeline_run},
        source="/apis///namespaces/ci//build-and-test-r8v2q",
        subject="build-and-test-r8v2q",
    )


def test_tekton_successful_event_becomes_run_finished() -> None:
    result = adapt_cloudevent(
        tekton_event("dev.tekton.event.pipelinerun.successful.v1", TEKTON_PIPELINERUN)
    )
    assert isinstance(result, RunFinished)
    run = result.run
    assert run.engine is Engine.TEKTON
    assert (run.api_version, run.kind) == ("tekton.dev/v1", "PipelineRun")
    assert run.subject == "ci/build-and-test-r8v2q"
    assert run.phase == "Succeeded"
    assert run.finished_at == datetime(2026, 3, 1, 12, 4, 30, tzinfo=UTC)  # completionTime
    assert run.annotations == {"lapse.dev/ttl": "2h"}
    assert run.ttl_strategy is None


def test_tekton_failed_event_becomes_failed_run() -> None:
    cancelled = changed(TEKTON_PIPELINERUN, "status.conditions.0.status", "False")
    cancelled = changed(cancelled, "status.conditions.0.reason", "Cancelled")
    result = adapt_cloudevent(tekton_event("dev.tekton.event.pipelinerun.failed.v1", cancelled))
    assert isinstance(result, RunFinished)
    assert result.run.phase == "Failed"


def test_tekton_finish_falls_back_to_condition_transition_time() -> None:
    no_completion = changed(TEKTON_PIPELINERUN, "status.completionTime", DELETE)
    result = adapt_pipelinerun(no_completion)
    assert isinstance(result, RunFinished)
    assert result.run.finished_at == datetime(2026, 3, 1, 12, 4, 31, tzinfo=UTC)


def test_tekton_object_in_another_version_is_named_by_the_configured_one() -> None:
    # Tekton's CloudEvents carry v1beta1; the reaper reads and deletes by the kind's version.
    typed = {"apiVersion": "tekton.dev/v1beta1", "kind": "PipelineRun", **TEKTON_PIPELINERUN}
    result = adapt_object(typed)
    assert isinstance(result, RunFinished)
    assert result.run.api_version == "tekton.dev/v1"


@pytest.mark.parametrize(
    "event_type",
    [
        "dev.tekton.event.pipelinerun.started.v1",
        "dev.tekton.event.pipelinerun.running.v1",
        "dev.tekton.event.pipelinerun.unknown.v1",
        "dev.tekton.event.taskrun.running.v1",
        "dev.tekton.event.customrun.failed.v1",
    ],
)
def test_tekton_progress_and_child_run_events_are_ignored(event_type: str) -> None:
    running = changed(TEKTON_PIPELINERUN, "status.conditions.0.status", "Unknown")
    result = adapt_cloudevent(tekton_event(event_type, running))
    assert isinstance(result, Ignored)
    assert event_type in result.reason


def test_unfinished_pipelinerun_object_is_ignored_or_deleted() -> None:
    running = changed(TEKTON_PIPELINERUN, "status.conditions.0.status", "Unknown")
    assert isinstance(adapt_pipelinerun(running), Ignored)
    deleted = adapt_pipelinerun(running, deleted=True)
    assert isinstance(deleted, RunDeleted)
    assert deleted.run.phase == "Running"
    assert deleted.run.finished_at is None
    assert isinstance(adapt_pipelinerun(changed(TEKTON_PIPELINERUN, "status", DELETE)), Ignored)


@pytest.mark.parametrize(
    ("event_type", "data", "reason"),
    [
        ("dev.tekton.event.pipelinerun.successful.v1", {}, "data has no pipelineRun"),
        ("dev.tekton.event.pipelinerun.successful.v1", [], "data must be a JSON object"),
        ("dev.tekton.event.pipelinerun.successful.v1", {"pipelineRun": "x"}, "PipelineRun must"),
        (
            "dev.tekton.event.pipelinerun.failed.v1",
            {"pipelineRun": TEKTON_PIPELINERUN},
            "in phase Succeeded",
        ),
        ("dev.tekton.event.pipelinerun.exploded.v1", {}, "unsupported Tekton event type"),
    ],
)
def test_malformed_tekton_events_are_invalid(event_type: str, data: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        adapt_tekton_event(event_type, data)


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("status.conditions", {"type": "Succeeded"}, "status.conditions must be a list"),
        ("status.conditions.0", "Succeeded", r"status.conditions\[0\] must be a JSON object"),
        ("status.conditions.0.status", True, "Succeeded condition status must be a string"),
        ("status.completionTime", "soon", "status.completionTime: not an RFC 3339"),
        ("metadata.uid", None, "metadata.uid is missing"),
    ],
)
def test_malformed_pipelineruns_are_invalid(path: str, value: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        adapt_pipelinerun(changed(TEKTON_PIPELINERUN, path, value))


# --- Jobs ----------------------------------------------------------------------------------


def test_complete_job_becomes_succeeded_run() -> None:
    result = adapt_object(JOB)
    assert isinstance(result, RunFinished)
    run = result.run
    assert run.engine is Engine.JOB
    assert (run.api_version, run.kind, run.phase) == ("batch/v1", "Job", "Succeeded")
    # The Complete condition's transition, not SuccessCriteriaMet's one second earlier.
    assert run.finished_at == datetime(2026, 3, 1, 12, 0, 6, tzinfo=UTC)


def test_failed_job_becomes_failed_run() -> None:
    failed = changed(
        JOB,
        "status.conditions",
        [
            {
                "type": "FailureTarget",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
                "lastProbeTime": "2026-03-01T12:10:00Z",
                "lastTransitionTime": "2026-03-01T12:10:00Z",
            },
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
                "lastProbeTime": "2026-03-01T12:10:02Z",
                "lastTransitionTime": "2026-03-01T12:10:02Z",
            },
        ],
    )
    failed = changed(failed, "status.completionTime", DELETE)
    result = adapt_job(failed)
    assert isinstance(result, RunFinished)
    assert result.run.phase == "Failed"
    assert result.run.finished_at == datetime(2026, 3, 1, 12, 10, 2, tzinfo=UTC)


def test_job_still_terminating_pods_is_not_finished() -> None:
    # SuccessCriteriaMet alone: pods may still be terminating, Complete has not been set.
    pending = changed(JOB, "status.conditions", JOB["status"]["conditions"][:1])
    assert isinstance(adapt_job(pending), Ignored)
    false_complete = changed(JOB, "status.conditions.1.status", "False")
    false_complete = changed(false_complete, "status.conditions.0.status", "False")
    assert isinstance(adapt_job(false_complete), Ignored)
    assert isinstance(adapt_job(changed(JOB, "status", {})), Ignored)


def test_job_finish_falls_back_to_completion_time() -> None:
    no_transition = changed(JOB, "status.conditions.1.lastTransitionTime", DELETE)
    result = adapt_job(no_transition)
    assert isinstance(result, RunFinished)
    assert result.run.finished_at == datetime(2026, 3, 1, 12, 0, 6, tzinfo=UTC)


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("status.conditions.1.lastTransitionTime", "noon", r"conditions\[1\]: not an RFC 3339"),
        ("status.conditions.1.type", ["Complete"], None),
        ("apiVersion", "batch/v2", None),
        ("kind", "CronJob", "expected batch Job"),
    ],
)
def test_malformed_jobs(path: str, value: Any, reason: str | None) -> None:
    obj = changed(JOB, path, value)
    if reason is None:
        # Odd but harmless: a non-string condition type just is not a finishing condition,
        # and another batch version is still a Job.
        assert isinstance(adapt_job(obj), RunFinished | Ignored)
        return
    with pytest.raises(InvalidEvent, match=reason):
        adapt_job(obj)


# --- Kubernetes Events from the Argo controller --------------------------------------------


@pytest.mark.parametrize("reason", ["WorkflowSucceeded", "WorkflowFailed", "WorkflowTimedOut"])
def test_argo_finish_events_need_a_fetch(reason: str) -> None:
    result = adapt_object(changed(ARGO_K8S_EVENT, "reason", reason))
    assert result == NeedsFetch(
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="kubeflow-user-example-com",
        name="train-pipeline-7xk2p",
        uid="5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11",
        deleted=False,
    )


def test_events_k8s_io_v1_event_uses_regarding() -> None:
    modern = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": ARGO_K8S_EVENT["metadata"],
        "regarding": {k: v for k, v in ARGO_K8S_EVENT["involvedObject"].items() if k != "uid"},
        "reason": "WorkflowFailed",
        "note": "Workflow failed",
        "type": "Warning",
        "reportingController": "workflow-controller",
    }
    result = adapt_kubernetes_event(modern)
    assert isinstance(result, NeedsFetch)
    assert (result.name, result.uid) == ("train-pipeline-7xk2p", None)


@pytest.mark.parametrize(
    "event",
    [
        changed(ARGO_K8S_EVENT, "reason", "WorkflowRunning"),
        changed(ARGO_K8S_EVENT, "reason", "WorkflowNodeSucceeded"),
        changed(ARGO_K8S_EVENT, "reason", ["WorkflowSucceeded"]),
        changed(ARGO_K8S_EVENT, "involvedObject.kind", "Pod"),
        changed(changed(ARGO_K8S_EVENT, "reason", "Scheduled"), "involvedObject.apiVersion", "v1"),
    ],
)
def test_other_cluster_events_are_ignored_not_invalid(event: dict[str, Any]) -> None:
    assert isinstance(adapt_object(event), Ignored)


def test_expired_event_says_nothing_about_the_run() -> None:
    result = adapt_object(ARGO_K8S_EVENT, deleted=True)
    assert isinstance(result, Ignored)


def test_finish_event_without_workflow_name_is_invalid() -> None:
    with pytest.raises(InvalidEvent, match="does not name the Workflow"):
        adapt_kubernetes_event(changed(ARGO_K8S_EVENT, "involvedObject.name", DELETE))
    # The namespace falls back to the Event's own, as the recorder always sets both.
    result = adapt_kubernetes_event(changed(ARGO_K8S_EVENT, "involvedObject.namespace", DELETE))
    assert isinstance(result, NeedsFetch)
    assert result.namespace == "kubeflow-user-example-com"


# --- Knative ApiServerSource ---------------------------------------------------------------


def apiserver_event(event_type: str, data: Any) -> CloudEvent:
    return cloudevent(
        event_type,
        data,
        subject="/apis/argoproj.io/v1alpha1/namespaces/kubeflow-user-example-com/workflows/"
        "train-pipeline-7xk2p",
    )


@pytest.mark.parametrize("verb", ["add", "update"])
def test_resource_mode_add_and_update_adapt_the_object(verb: str) -> None:
    result = adapt_cloudevent(
        apiserver_event(f"dev.knative.apiserver.resource.{verb}", KFP_WORKFLOW)
    )
    assert result == adapt_workflow(KFP_WORKFLOW)
    running = changed(KFP_WORKFLOW, "status.phase", "Running")
    ignored = adapt_cloudevent(apiserver_event(f"dev.knative.apiserver.resource.{verb}", running))
    assert isinstance(ignored, Ignored)


def test_resource_mode_delete_is_run_deleted() -> None:
    result = adapt_cloudevent(
        apiserver_event("dev.knative.apiserver.resource.delete", KFP_WORKFLOW)
    )
    assert isinstance(result, RunDeleted)
    assert result.run.uid == KFP_WORKFLOW["metadata"]["uid"]


def test_resource_mode_data_as_json_bytes() -> None:
    event = apiserver_event(
        "dev.knative.apiserver.resource.update", json.dumps(KFP_WORKFLOW).encode()
    )
    assert isinstance(adapt_cloudevent(event), RunFinished)


def test_resource_mode_kubernetes_event_object() -> None:
    result = adapt_cloudevent(apiserver_event("dev.knative.apiserver.resource.add", ARGO_K8S_EVENT))
    assert isinstance(result, NeedsFetch)
    deleted = adapt_cloudevent(
        apiserver_event("dev.knative.apiserver.resource.delete", ARGO_K8S_EVENT)
    )
    assert isinstance(deleted, Ignored)


REFERENCE = {
    "apiVersion": "argoproj.io/v1alpha1",
    "kind": "Workflow",
    "name": "train-pipeline-7xk2p",
    "namespace": "kubeflow-user-example-com",
}


@pytest.mark.parametrize(("verb", "deleted"), [("add", False), ("update", False), ("delete", True)])
def test_reference_mode_needs_a_fetch(verb: str, deleted: bool) -> None:
    result = adapt_cloudevent(apiserver_event(f"dev.knative.apiserver.ref.{verb}", REFERENCE))
    assert result == NeedsFetch(
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="kubeflow-user-example-com",
        name="train-pipeline-7xk2p",
        uid=None,
        deleted=deleted,
    )


def test_reference_mode_for_jobs_and_expired_events() -> None:
    job_ref = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "namespace": "n"}
    result = adapt_cloudevent(apiserver_event("dev.knative.apiserver.ref.add", job_ref))
    assert isinstance(result, NeedsFetch) and result.kind == "Job"
    event_ref = {"apiVersion": "v1", "kind": "Event", "name": "e", "namespace": "n"}
    gone = adapt_cloudevent(apiserver_event("dev.knative.apiserver.ref.delete", event_ref))
    assert isinstance(gone, Ignored)


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (
            apiserver_event("dev.knative.apiserver.ref.add", {**REFERENCE, "kind": "Pod"}),
            "Pod of argoproj.io is not a kind lapse is configured for",
        ),
        (
            apiserver_event("dev.knative.apiserver.ref.add", {**REFERENCE, "name": ""}),
            "reference name is missing",
        ),
        (
            apiserver_event("dev.knative.apiserver.ref.add", {"kind": "Workflow"}),
            "reference apiVersion is missing",
        ),
        (
            apiserver_event(
                "dev.knative.apiserver.resource.add", {"apiVersion": "v1", "kind": "Pod"}
            ),
            "Pod of the core group is not a kind lapse is configured for",
        ),
        (apiserver_event("dev.knative.apiserver.resource.add", None), "has no data"),
        (apiserver_event("dev.knative.apiserver.resource.add", "not json"), "not valid JSON"),
        (
            apiserver_event("dev.knative.apiserver.resource.add", 7),
            "must be a JSON object, not number",
        ),
        (
            cloudevent("dev.knative.apiserver.resource.add", {}, datacontenttype="text/xml"),
            "is not JSON",
        ),
        (cloudevent("com.github.push", {}), "unsupported event type 'com.github.push'"),
        (cloudevent("dev.lapse.cleanup.due.v1", {}), "unsupported event type"),
    ],
)
def test_unusable_cloudevents_are_invalid(event: CloudEvent, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        adapt_cloudevent(event)


def test_normalized_lapse_events_pass_through() -> None:
    finished = adapt_workflow(KFP_WORKFLOW)
    assert isinstance(finished, RunFinished)
    event = build_event(EventType.RUN_FINISHED, source="/elsewhere", data=finished)
    assert adapt_cloudevent(event) == finished
    deleted = RunDeleted(run=finished.run)
    event = build_event(EventType.RUN_DELETED, source="/elsewhere", data=deleted)
    assert adapt_cloudevent(event) == deleted
    broken = cloudevent("dev.lapse.run.finished.v1", {"run": {}})
    with pytest.raises(InvalidEvent, match=r"run\.engine: Field required"):
        adapt_cloudevent(broken)


# --- property tests: anything in, a result or InvalidEvent out ------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=16,
)
RESULTS = (RunFinished, RunDeleted, Ignored, NeedsFetch)
ADAPTERS = [adapt_workflow, adapt_pipelinerun, adapt_job, adapt_kubernetes_event, adapt_object]


def result_or_invalid(call: Any, *args: Any) -> None:
    try:
        result = call(*args)
    except InvalidEvent as exc:
        assert exc.reason
    else:
        assert isinstance(result, RESULTS)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_arbitrary_json_objects(value: Any, deleted: bool) -> None:
    for adapter in ADAPTERS:
        result_or_invalid(adapter, value, deleted)


def paths(obj: Any, prefix: str = "") -> list[str]:
    found = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    for key, value in items:
        path = f"{prefix}{key}"
        found.append(path)
        found.extend(paths(value, path + "."))
    return found


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A realistic object with a few fields replaced by arbitrary JSON, or removed."""
    obj = base
    for path in draw(st.lists(st.sampled_from(paths(base)), min_size=1, max_size=3)):
        try:
            obj = changed(obj, path, draw(st.just(DELETE) | json_values))
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # an earlier mutation removed or replaced this path's parent
    return obj


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        mutated(KFP_WORKFLOW),
        mutated(JOB),
        mutated(ARGO_K8S_EVENT),
        mutated({"apiVersion": "tekton.dev/v1", "kind": "PipelineRun", **TEKTON_PIPELINERUN}),
    ),
    st.booleans(),
)
def test_mutated_real_objects(obj: dict[str, Any], deleted: bool) -> None:
    result_or_invalid(adapt_object, obj, deleted)


EVENT_TYPES = [
    *(
        f"dev.knative.apiserver.{mode}.{verb}"
        for mode in ("resource", "ref")
        for verb in ("add", "update", "delete")
    ),
    *(f"dev.tekton.event.pipelinerun.{state}.v1" for state in ("started", "successful", "failed")),
    "dev.lapse.run.finished.v1",
    "dev.lapse.run.deleted.v1",
    "dev.lapse.cleanup.due.v1",
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(EVENT_TYPES) | st.text(min_size=1),
    json_values
    | mutated(KFP_WORKFLOW)
    | mutated({"pipelineRun": TEKTON_PIPELINERUN})
    | mutated(REFERENCE)
    | st.binary(max_size=32),
)
def test_arbitrary_cloudevents(event_type: str, data: Any) -> None:
    result_or_invalid(adapt_cloudevent, cloudevent(event_type, data))


# --- kinds as configuration (events/kinds.py) ---------------------------------------------


def taskrun(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tekton.dev/v1",
        "kind": "TaskRun",
        "metadata": {
            "name": "unit-tests",
            "namespace": "ci",
            "uid": "tr-1",
            "resourceVersion": "7",
        },
        "status": {
            "conditions": [
                {
                    "type": "Succeeded",
                    "status": "True",
                    "lastTransitionTime": "2026-03-01T12:00:05Z",
                }
            ],
            "completionTime": "2026-03-01T12:00:04Z",
            **status,
        },
    }


def test_standalone_taskrun_event_becomes_run_finished() -> None:
    event = cloudevent("dev.tekton.event.taskrun.successful.v1", {"taskRun": taskrun()})
    result = adapt_cloudevent(event)
    assert isinstance(result, RunFinished)
    assert (result.run.kind, result.run.engine, result.run.phase) == (
        "TaskRun",
        "tekton",
        "Succeeded",
    )
    assert result.run.finished_at == datetime(2026, 3, 1, 12, 0, 4, tzinfo=UTC)


def test_taskrun_of_a_pipelinerun_is_left_to_it() -> None:
    owned = taskrun()
    owned["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "tekton.dev/v1",
            "kind": "PipelineRun",
            "name": "p",
            "uid": "p-1",
            "controller": True,
        }
    ]
    result = adapt_cloudevent(
        cloudevent("dev.tekton.event.taskrun.successful.v1", {"taskRun": owned})
    )
    assert isinstance(result, Ignored)
    assert "controlled by PipelineRun/p" in result.reason


def test_taskrun_event_for_a_kind_not_configured_is_ignored() -> None:
    only_argo = resolve_kinds(["argo-workflow"])
    event = cloudevent("dev.tekton.event.taskrun.failed.v1", {"taskRun": taskrun()})
    result = adapt_cloudevent(event, only_argo)
    assert isinstance(result, Ignored)
    assert "not one of lapse's configured kinds" in result.reason


def test_object_of_a_kind_not_configured_is_refused_with_the_configured_kinds() -> None:
    only_jobs = resolve_kinds(["job"])
    with pytest.raises(InvalidEvent, match=r"not a kind lapse is configured for \(kinds: Job"):
        adapt_object(taskrun(), kinds=only_jobs)


TRAINJOB_OBJ: dict[str, Any] = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "TrainJob",
    "metadata": {"name": "llama", "namespace": "ml", "uid": "tj-1", "resourceVersion": "3"},
    "status": {
        "conditions": [
            {"type": "Suspended", "status": "False", "lastTransitionTime": "2026-03-01T10:00:00Z"},
            {
                "type": "Complete",
                "status": "True",
                "reason": "JobsCompleted",
                "lastTransitionTime": "2026-03-01T11:00:00Z",
            },
        ]
    },
}


def test_trainjob_finishes_on_complete_with_its_transition_time() -> None:
    result = adapt_object(TRAINJOB_OBJ)
    assert isinstance(result, RunFinished)
    assert (result.run.engine, result.run.phase) == ("trainer", "Succeeded")
    assert result.run.finished_at == datetime(2026, 3, 1, 11, 0, tzinfo=UTC)
    running = changed(TRAINJOB_OBJ, "status.conditions.1.status", "False")
    assert isinstance(adapt_object(running), Ignored)


def test_job_ttl_seconds_after_finished_is_the_engine_ttl() -> None:
    job = {**JOB, "spec": {"ttlSecondsAfterFinished": 600}}
    result = adapt_job(job)
    assert isinstance(result, RunFinished)
    assert result.run.ttl_strategy is not None
    assert result.run.ttl_strategy.seconds_after_completion == 600
    with pytest.raises(InvalidEvent, match="ttlSecondsAfterFinished must be an integer"):
        adapt_job({**JOB, "spec": {"ttlSecondsAfterFinished": "600"}})


def test_a_jobs_own_ttl_is_named_by_its_field_not_argos() -> None:
    # plan, history and the demo show this label: a Job has no ttlStrategy.
    result = adapt_job({**JOB, "spec": {"ttlSecondsAfterFinished": 600}})
    assert isinstance(result, RunFinished)
    decision = decide(result.run, Target.KUBERNETES, [], datetime(2026, 3, 1, tzinfo=UTC))
    assert decision.policy == "job:spec.ttlSecondsAfterFinished"
    assert "spec.ttlSecondsAfterFinished=600" in decision.reason
    assert result.run.finished_at is not None
    assert decision.deadline == result.run.finished_at + timedelta(seconds=600)


def test_job_of_a_cronjob_is_left_to_it() -> None:
    owned = changed(
        JOB,
        "metadata.ownerReferences",
        [
            {
                "apiVersion": "batch/v1",
                "kind": "CronJob",
                "name": "nightly",
                "uid": "c",
                "controller": True,
            }
        ],
    )
    result = adapt_job(owned)
    assert isinstance(result, Ignored) and "CronJob/nightly" in result.reason


def test_workflow_from_a_template_uses_the_stored_template_ttl_strategy() -> None:
    wf = changed(KFP_WORKFLOW, "spec", {"workflowTemplateRef": {"name": "nightly"}})
    wf = changed(
        wf, "status.storedWorkflowTemplateSpec", {"ttlStrategy": {"secondsAfterSuccess": 60}}
    )
    result = adapt_workflow(wf)
    assert isinstance(result, RunFinished)
    assert result.run.ttl_strategy is not None
    assert result.run.ttl_strategy.seconds_after_success == 60


def test_workflow_own_ttl_strategy_wins_over_the_template_as_a_whole() -> None:
    # Argo's GetTTLStrategy: the Workflow's spec.ttlStrategy replaces the template's, it is
    # not merged field by field.
    wf = changed(KFP_WORKFLOW, "spec.ttlStrategy", {"secondsAfterFailure": 5})
    wf = changed(
        wf, "status.storedWorkflowTemplateSpec", {"ttlStrategy": {"secondsAfterSuccess": 60}}
    )
    result = adapt_workflow(wf)
    assert isinstance(result, RunFinished) and result.run.ttl_strategy is not None
    assert result.run.ttl_strategy.seconds_after_success is None
    assert result.run.ttl_strategy.seconds_after_failure == 5


def test_declared_kind_is_read_by_its_configuration() -> None:
    spec = KindSpec.model_validate(
        {
            "name": "spark-app",
            "api_version": "sparkoperator.k8s.io/v1beta2",
            "kind": "SparkApplication",
            "resource": "sparkapplications",
            "finished": {
                "field": "status.applicationState.state",
                "phases": ["COMPLETED", "FAILED"],
                "at": ["status.terminationTime"],
            },
        }
    )
    app = {
        "apiVersion": "sparkoperator.k8s.io/v1beta2",
        "kind": "SparkApplication",
        "metadata": {"name": "pi", "namespace": "spark", "uid": "s-1"},
        "status": {
            "applicationState": {"state": "COMPLETED"},
            "terminationTime": "2026-03-01T09:00:00Z",
        },
    }
    result = adapt_object(app, kinds=KindSet([spec]))
    assert isinstance(result, RunFinished)
    assert (result.run.engine, result.run.phase) == ("other", "COMPLETED")
    assert result.run.finished_at == datetime(2026, 3, 1, 9, 0, tzinfo=UTC)
