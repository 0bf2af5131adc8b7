"""Every built-in kind, planned and deleted by the same pipeline, against a real
kube-apiserver with the real CRDs (Tekton v1.6.0 PipelineRun/TaskRun, Kubeflow Trainer
v2.0.0 TrainJob, KubeRay v1.5.1 RayJob, JobSet v0.11.1, Spark Operator v2.4.0
SparkApplication, read from the pinned Go modules) and real batch/v1 Jobs, and real NATS.

No engine controller runs: objects are written finished, as their controller would leave
them (status through the status subresource). API requests are counted by the API server
itself (`apiserver_request_total` on its /metrics), not by lapse.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from cloudevents.core.base import BaseCloudEvent
from kubernetes import client
from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges.kubernetes import KubeObjects
from lapse.edges.kubernetes.reaping import ReapedObjects
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.adapters import Ignored
from lapse.events.adapters.objects import adapt
from lapse.events.builder import build_event, parse_payload
from lapse.events.kinds import (
    ARGO_WORKFLOW,
    BUILTIN_KINDS,
    JOB,
    JOBSET,
    RAYJOB,
    SPARK_APPLICATION,
    TEKTON_PIPELINERUN,
    TEKTON_TASKRUN,
    TRAINJOB,
    KindSpec,
    resolve_kinds,
)
from lapse.events.models import (
    CleanupCompleted,
    CleanupDue,
    CleanupFailed,
    CleanupScheduled,
    RunFinished,
)
from lapse.events.run import Target
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper import ObjectReaper
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Trust
from lapse.functions.ttl_planner import Planner
from tests.conftest import KubeStack
from tests.engine_objects import succeeded_job_status
from tests.unit.test_object_reaper_verdict import argo_workflow

STREAMS = Streams()
PREFIX = "kinds-"
# The opt-in kinds too: a reaper or planner of the default configuration refuses them.
EVERY_KIND = resolve_kinds(BUILTIN_KINDS)


@pytest.fixture(autouse=True)
def leave_nothing(kube: KubeStack) -> Iterator[None]:
    """The API server is shared by the session: remove what these tests create."""
    yield
    custom = client.CustomObjectsApi(kube.api_client)
    for namespace in client.CoreV1Api(kube.api_client).list_namespace().items:
        name = namespace.metadata.name
        if not name.startswith(PREFIX):
            continue
        for spec in BUILTIN_KINDS.values():
            # Background: the API's default for Jobs is Orphan, whose finalizer only the
            # garbage collector (not running here) would remove.
            custom.delete_collection_namespaced_custom_object(
                spec.group,
                spec.version,
                name,
                spec.resource,
                body=client.V1DeleteOptions(propagation_policy="Background"),
            )


def ago(seconds: float) -> str:
    return format_rfc3339(datetime.now(UTC) - timedelta(seconds=seconds))


def meta(namespace: str, name: str, ttl: str | None = "10m", **extra: Any) -> dict[str, Any]:
    """`ttl` None: no lapse.dev/ttl, so the engine's own TTL (or a policy) decides."""
    annotations = {"lapse.dev/ttl": ttl} if ttl is not None else {}
    return {"name": name, "namespace": namespace, "annotations": annotations, **extra}


def condition(kind: str, status: str, when: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": kind,
        "message": "",
        "lastTransitionTime": when,
    }


def pipelinerun(namespace: str, name: str, **meta_extra: Any) -> tuple[dict[str, Any], dict]:
    body = {
        "apiVersion": "tekton.dev/v1",
        "kind": "PipelineRun",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": {"pipelineRef": {"name": "build"}},
    }
    finished = ago(20 * 60)
    status = {
        "startTime": ago(25 * 60),
        "completionTime": finished,
        "conditions": [condition("Succeeded", "True", finished)],
    }
    return body, status


def taskrun(
    namespace: str, name: str, *, done: bool = True, **meta_extra: Any
) -> tuple[dict[str, Any], dict]:
    body = {
        "apiVersion": "tekton.dev/v1",
        "kind": "TaskRun",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": {"taskRef": {"name": "unit-tests"}},
    }
    finished = ago(20 * 60)
    status: dict[str, Any] = {"startTime": ago(25 * 60), "podName": f"{name}-pod"}
    if done:
        status["completionTime"] = finished
        status["conditions"] = [condition("Succeeded", "True", finished)]
    else:
        status["conditions"] = [condition("Succeeded", "Unknown", finished)]
    return body, status


def job(namespace: str, name: str, **meta_extra: Any) -> tuple[dict[str, Any], dict]:
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "registry.invalid/report:1"}],
                }
            }
        },
    }
    return body, succeeded_job_status(ago(25 * 60), ago(20 * 60))


def trainjob(namespace: str, name: str, **meta_extra: Any) -> tuple[dict[str, Any], dict]:
    body = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": {"runtimeRef": {"name": "torch-distributed"}},
    }
    finished = ago(20 * 60)
    status = {"conditions": [condition("Complete", "True", finished)]}
    return body, status


def rayjob(
    namespace: str,
    name: str,
    *,
    done: bool = True,
    ttl_seconds: int | None = None,
    **meta_extra: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A RayJob as KubeRay leaves it: jobDeploymentStatus Complete, endTime set when it
    turned so. `ttl_seconds` sets KubeRay's own TTL with shutdownAfterJobFinishes."""
    spec: dict[str, Any] = {"entrypoint": "python train.py"}
    if ttl_seconds is not None:
        spec |= {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": ttl_seconds}
    body = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": spec,
    }
    status: dict[str, Any] = {"startTime": ago(25 * 60), "jobId": f"{name}-raysubmit"}
    if done:
        status |= {
            "jobStatus": "SUCCEEDED",
            "jobDeploymentStatus": "Complete",
            "endTime": ago(20 * 60),
        }
    else:
        status |= {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}
    return body, status


def jobset(
    namespace: str,
    name: str,
    *,
    done: bool = True,
    ttl_seconds: int | None = None,
    **meta_extra: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A JobSet as its controller leaves it: Completed True, terminalState Completed."""
    pod = {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "registry.invalid/train:1"}],
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {"name": "workers", "replicas": 1, "template": {"spec": {"template": {"spec": pod}}}}
        ]
    }
    if ttl_seconds is not None:
        spec["ttlSecondsAfterFinished"] = ttl_seconds
    body = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": spec,
    }
    finished = ago(20 * 60)
    status: dict[str, Any] = {"restarts": 0}
    if done:
        status |= {
            "terminalState": "Completed",
            "conditions": [condition("Completed", "True", finished)],
        }
    else:
        status["conditions"] = [condition("StartupPolicyCompleted", "True", finished)]
    return body, status


def sparkapplication(
    namespace: str,
    name: str,
    *,
    done: bool = True,
    ttl_seconds: int | None = None,
    **meta_extra: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A SparkApplication as the operator leaves it: COMPLETED, terminationTime set."""
    spec: dict[str, Any] = {
        "type": "Python",
        "mode": "cluster",
        "sparkVersion": "3.5.5",
        "mainApplicationFile": "local:///opt/spark/examples/src/main/python/pi.py",
        "driver": {"cores": 1, "memory": "512m"},
        "executor": {"instances": 1, "cores": 1, "memory": "512m"},
    }
    if ttl_seconds is not None:
        spec["timeToLiveSeconds"] = ttl_seconds
    body = {
        "apiVersion": "sparkoperator.k8s.io/v1beta2",
        "kind": "SparkApplication",
        "metadata": meta(namespace, name, **meta_extra),
        "spec": spec,
    }
    status: dict[str, Any] = {
        "driverInfo": {"podName": f"{name}-driver"},
        "lastSubmissionAttemptTime": ago(25 * 60),
    }
    if done:
        status |= {"applicationState": {"state": "COMPLETED"}, "terminationTime": ago(20 * 60)}
    else:
        status["applicationState"] = {"state": "RUNNING"}
    return body, status


MAKERS = {
    TEKTON_PIPELINERUN.name: pipelinerun,
    TEKTON_TASKRUN.name: taskrun,
    JOB.name: job,
    TRAINJOB.name: trainjob,
    RAYJOB.name: rayjob,
    JOBSET.name: jobset,
    SPARK_APPLICATION.name: sparkapplication,
}
KINDS = {
    spec.name: spec
    for spec in (
        TEKTON_PIPELINERUN,
        TEKTON_TASKRUN,
        JOB,
        TRAINJOB,
        RAYJOB,
        JOBSET,
        SPARK_APPLICATION,
    )
}
# The opt-in kinds, each with its engine's own TTL field (as `plan` and `history` name it).
ENGINE_TTL_KINDS = {
    RAYJOB.name: "rayjob:spec.ttlSecondsAfterFinished",
    JOBSET.name: "jobset:spec.ttlSecondsAfterFinished",
    SPARK_APPLICATION.name: "sparkapplication:spec.timeToLiveSeconds",
}


@dataclass
class Stage:
    kube: KubeStack
    js: JetStreamContext
    objects: KubeObjects

    async def finished(self, spec: KindSpec, namespace: str, name: str, **meta_extra: Any) -> Any:
        """The object as its controller leaves it: created, then its status written."""
        body, status = MAKERS[spec.name](namespace, name, **meta_extra)
        created = await self.objects.create(spec, namespace, body)
        created["status"] = status
        return await self.objects.replace_status(spec, namespace, name, created)

    def planner(self) -> Planner:
        return Planner(
            schedules=NatsScheduleStore(self.js, STREAMS),
            emitter=NatsEmitter(self.js, STREAMS),
            kinds=EVERY_KIND,
        )

    def reaper(self, **kwargs: Any) -> ObjectReaper:
        safety = kwargs.pop("safety", SafetyConfig())
        kwargs.setdefault("kinds", EVERY_KIND)
        return ObjectReaper(
            objects=ReapedObjects(self.objects),
            schedules=NatsScheduleStore(self.js, STREAMS),
            emitter=NatsEmitter(self.js, STREAMS),
            safety=safety,
            request_timeout=10,
            **kwargs,
        )

    async def exists(self, spec: KindSpec, obj: dict[str, Any]) -> bool:
        current = await self.objects.get(
            spec, obj["metadata"]["namespace"], obj["metadata"]["name"]
        )
        return current is not None and current["metadata"]["uid"] == obj["metadata"]["uid"]


@pytest.fixture
def stage(kube: KubeStack, lapse_streams: JetStreamContext) -> Stage:
    return Stage(kube, lapse_streams, KubeObjects(kube.api_client, kube.executor, EVERY_KIND))


def due_event(spec: KindSpec, obj: dict[str, Any], deadline_shift: float = 0) -> BaseCloudEvent:
    """What the planner scheduled for `obj`: finish + 10m (the lapse.dev/ttl annotation)."""
    finished = adapt(obj, spec)
    assert isinstance(finished, RunFinished) and finished.run.finished_at is not None
    deadline = finished.run.finished_at + timedelta(minutes=10, seconds=deadline_shift)
    due = CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=deadline,
        policy="annotation:lapse.dev/ttl",
        scheduled_at=finished.run.finished_at,
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=due)


def outcome(events: list[BaseCloudEvent]) -> CleanupCompleted | CleanupFailed:
    assert len(events) == 1, [e.get_type() for e in events]
    payload = parse_payload(events[0])
    assert isinstance(payload, CleanupCompleted | CleanupFailed)
    return payload


def requests_by_verb(kube: KubeStack, resource: str) -> dict[str, int]:
    """The API server's own count of requests on `resource`, by verb (its /metrics)."""
    server = kube.server
    response = httpx.get(
        f"{server.url}/metrics",
        headers={"Authorization": f"Bearer {server.admin_token}"},
        verify=False,  # loopback, the certificate the API server made for itself
        timeout=10,
    )
    response.raise_for_status()
    counts: dict[str, int] = {}
    for line in response.text.splitlines():
        if not line.startswith("apiserver_request_total{") or f'resource="{resource}"' not in line:
            continue
        labels, _, value = line.rpartition(" ")
        verb = labels.split('verb="', 1)[1].split('"', 1)[0]
        counts[verb] = counts.get(verb, 0) + int(float(value))
    return counts


def spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        v: after.get(v, 0) - before.get(v, 0) for v in after if after.get(v, 0) != before.get(v, 0)
    }


@pytest.mark.parametrize("name", list(KINDS))
async def test_each_kind_is_deleted_at_its_deadline_and_not_before(stage: Stage, name: str) -> None:
    spec = KINDS[name]
    ns = stage.kube.namespace(f"{PREFIX}{name}")
    obj = await stage.finished(spec, ns, f"run-{uuid.uuid4().hex[:6]}")
    reaper = stage.reaper()

    # Early (the object now says 10m after a finish 20m ago; this event thinks it is due
    # but the deadline was extended by an hour): never deleted early.
    extended = await stage.objects.get(spec, ns, obj["metadata"]["name"])
    assert extended is not None
    extended["metadata"]["annotations"]["lapse.dev/ttl"] = "1h10m"
    extended = await stage.objects.replace(spec, ns, obj["metadata"]["name"], extended)
    early = outcome(await reaper.handle(due_event(spec, obj)))
    assert isinstance(early, CleanupCompleted) and early.outcome is Outcome.RESCHEDULED
    assert await stage.exists(spec, obj)

    extended["metadata"]["annotations"]["lapse.dev/ttl"] = "10m"
    current = await stage.objects.replace(spec, ns, obj["metadata"]["name"], extended)
    deleted = outcome(await reaper.handle(due_event(spec, current)))
    assert isinstance(deleted, CleanupCompleted) and deleted.outcome is Outcome.DELETED, deleted
    assert deleted.run.kind == spec.kind and deleted.run.engine == spec.engine
    assert "propagation Background" in (deleted.detail or "")
    assert not await stage.exists(spec, obj)


@pytest.mark.parametrize("name", list(KINDS))
async def test_a_reused_name_and_keep_are_honoured(stage: Stage, name: str) -> None:
    spec = KINDS[name]
    ns = stage.kube.namespace(f"{PREFIX}{name}-reuse")
    old = await stage.finished(spec, ns, "reused")
    event = due_event(spec, old)
    await stage.objects.delete(spec, ns, "reused", uid=old["metadata"]["uid"])
    new = await stage.finished(spec, ns, "reused")
    replaced = outcome(await stage.reaper().handle(event))
    assert isinstance(replaced, CleanupCompleted) and replaced.outcome is Outcome.REPLACED
    assert await stage.exists(spec, new)

    kept = await stage.finished(spec, ns, "kept", labels={"team": "a"})
    kept["metadata"]["annotations"]["lapse.dev/keep"] = "true"
    kept = await stage.objects.replace(spec, ns, "kept", kept)
    result = outcome(await stage.reaper().handle(due_event(spec, kept)))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.KEPT
    assert await stage.exists(spec, kept)


EXPECTED_REQUESTS = {
    # read first, then the guarded DELETE; a PipelineRun also lists its TaskRuns.
    (TEKTON_PIPELINERUN.name, True): {
        "pipelineruns": {"GET": 1, "DELETE": 1},
        "taskruns": {"LIST": 1},
    },
    (TEKTON_TASKRUN.name, True): {"taskruns": {"GET": 1, "DELETE": 1}},
    (JOB.name, True): {"jobs": {"GET": 1, "DELETE": 1}},
    (TRAINJOB.name, True): {"trainjobs": {"GET": 1, "DELETE": 1}},
    (RAYJOB.name, True): {"rayjobs": {"GET": 1, "DELETE": 1}},
    (JOBSET.name, True): {"jobsets": {"GET": 1, "DELETE": 1}},
    (SPARK_APPLICATION.name, True): {"sparkapplications": {"GET": 1, "DELETE": 1}},
    # read_before_delete off: one DELETE held to the planned version (not for PipelineRuns,
    # whose gate needs the fresh TaskRuns).
    (TEKTON_PIPELINERUN.name, False): {
        "pipelineruns": {"GET": 1, "DELETE": 1},
        "taskruns": {"LIST": 1},
    },
    (TEKTON_TASKRUN.name, False): {"taskruns": {"DELETE": 1}},
    (JOB.name, False): {"jobs": {"DELETE": 1}},
    (TRAINJOB.name, False): {"trainjobs": {"DELETE": 1}},
    (RAYJOB.name, False): {"rayjobs": {"DELETE": 1}},
    (JOBSET.name, False): {"jobsets": {"DELETE": 1}},
    (SPARK_APPLICATION.name, False): {"sparkapplications": {"DELETE": 1}},
}


@pytest.mark.parametrize(("name", "read_first"), list(EXPECTED_REQUESTS))
async def test_api_requests_per_deletion_counted_by_the_api_server(
    stage: Stage, name: str, read_first: bool
) -> None:
    spec = KINDS[name]
    ns = stage.kube.namespace(f"{PREFIX}{name}-count")
    obj = await stage.finished(spec, ns, f"counted-{uuid.uuid4().hex[:6]}")
    reaper = stage.reaper(safety=SafetyConfig(read_before_delete=read_first))
    expected = EXPECTED_REQUESTS[(name, read_first)]
    before = {r: requests_by_verb(stage.kube, r) for r in expected}
    result = outcome(await reaper.handle(due_event(spec, obj)))
    after = {r: requests_by_verb(stage.kube, r) for r in expected}
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.DELETED
    assert {r: spent(before[r], after[r]) for r in expected} == expected


@pytest.mark.parametrize("observed", [True, False])
async def test_auto_reads_first_unless_lapse_itself_read_the_planned_version(
    stage: Stage, observed: bool
) -> None:
    """read_before_delete: auto (the default): a due event the runtime hands over as
    carrying a version lapse read (`Trust.OBSERVED`) costs one DELETE; any other is read
    first."""
    ns = stage.kube.namespace(f"{PREFIX}auto-{str(observed).lower()}")
    obj = await stage.finished(JOB, ns, f"auto-{uuid.uuid4().hex[:6]}")
    expected = {"jobs": {"DELETE": 1}} if observed else {"jobs": {"GET": 1, "DELETE": 1}}
    before = requests_by_verb(stage.kube, "jobs")
    trust = Trust.OBSERVED if observed else Trust.CLAIM
    result = outcome(await stage.reaper().handle(due_event(JOB, obj), trust))
    after = requests_by_verb(stage.kube, "jobs")
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.DELETED
    assert {"jobs": spent(before, after)} == expected


@pytest.mark.parametrize("setting", [False, "auto"])
async def test_a_planned_version_that_changed_is_read_again_before_deleting(
    stage: Stage, setting: bool | str
) -> None:
    """The DELETE is held to the version the planner read (read_before_delete off, or auto
    with a version lapse read); the object changed since (keep added), so the server
    refuses it (409) and the fresh read keeps the object."""
    ns = stage.kube.namespace(f"{PREFIX}changed-{str(setting).lower()}")
    obj = await stage.finished(JOB, ns, "changed")
    event = due_event(JOB, obj)
    obj["metadata"]["annotations"]["lapse.dev/keep"] = "true"
    await stage.objects.replace(JOB, ns, "changed", obj)
    reaper = stage.reaper(safety=SafetyConfig.model_validate({"read_before_delete": setting}))
    result = outcome(await reaper.handle(event, Trust.OBSERVED))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.KEPT
    assert await stage.exists(JOB, obj)


async def test_a_pipelinerun_waits_for_its_running_taskruns(stage: Stage) -> None:
    ns = stage.kube.namespace(f"{PREFIX}gate")
    run = await stage.finished(TEKTON_PIPELINERUN, ns, "cancelled")
    owner = {
        "apiVersion": "tekton.dev/v1",
        "kind": "PipelineRun",
        "name": "cancelled",
        "uid": run["metadata"]["uid"],
        "controller": True,
    }
    child = {"labels": {"tekton.dev/pipelineRun": "cancelled"}, "ownerReferences": [owner]}
    body, status = taskrun(ns, "cancelled-build", done=False, **child)
    created = await stage.objects.create(TEKTON_TASKRUN, ns, body)
    created["status"] = status
    stopping = await stage.objects.replace_status(TEKTON_TASKRUN, ns, "cancelled-build", created)

    held = outcome(await stage.reaper().handle(due_event(TEKTON_PIPELINERUN, run)))
    assert isinstance(held, CleanupCompleted) and held.outcome is Outcome.RESCHEDULED
    assert "TaskRun(s) still running: cancelled-build" in (held.detail or "")
    assert await stage.exists(TEKTON_PIPELINERUN, run)

    stopping["status"] = taskrun(ns, "x")[1]
    await stage.objects.replace_status(TEKTON_TASKRUN, ns, "cancelled-build", stopping)
    done = outcome(await stage.reaper().handle(due_event(TEKTON_PIPELINERUN, run)))
    assert isinstance(done, CleanupCompleted) and done.outcome is Outcome.DELETED
    assert not await stage.exists(TEKTON_PIPELINERUN, run)


async def test_a_kind_the_configuration_does_not_list_is_refused_and_kept(
    stage: Stage,
) -> None:
    ns = stage.kube.namespace(f"{PREFIX}unlisted")
    obj = await stage.finished(JOB, ns, "unlisted")
    only_argo = resolve_kinds(["argo-workflow"])
    result = outcome(await stage.reaper(kinds=only_argo).handle(due_event(JOB, obj)))
    assert isinstance(result, CleanupFailed)
    assert "Job of batch is not a kind lapse is configured for" in result.reason
    assert result.original is not None  # the due event, for `lapse dlq replay`
    assert await stage.exists(JOB, obj)

    planner = Planner(
        schedules=NatsScheduleStore(stage.js, STREAMS),
        emitter=NatsEmitter(stage.js, STREAMS),
        kinds=only_argo,
    )
    finished = adapt(obj, JOB)
    assert isinstance(finished, RunFinished)
    [refused] = await planner.handle(
        build_event(EventType.RUN_FINISHED, source="/test", data=finished), Trust.OBSERVED
    )
    payload = parse_payload(refused)
    assert (
        isinstance(payload, CleanupFailed)
        and "is not a kind lapse is configured for" in payload.reason
    )


async def test_a_workflow_from_a_template_is_deleted_by_the_templates_ttl(
    stage: Stage,
) -> None:
    """Argo's own rule (argo-workflows#3227): a Workflow submitted from a WorkflowTemplate
    lives by the template's ttlStrategy, stored in status.storedWorkflowTemplateSpec."""
    ns = stage.kube.namespace(f"{PREFIX}template")
    finished_at = datetime.now(UTC) - timedelta(seconds=90)
    body = argo_workflow("from-template", namespace=ns, finished_at=finished_at)
    body["spec"] = {"workflowTemplateRef": {"name": "nightly"}}
    body["status"]["storedWorkflowTemplateSpec"] = {"ttlStrategy": {"secondsAfterSuccess": 60}}
    wf = await stage.kube.workflows.create(ns, body)
    planner = Planner(
        schedules=NatsScheduleStore(stage.js, STREAMS), emitter=NatsEmitter(stage.js, STREAMS)
    )
    finished = adapt(wf, ARGO_WORKFLOW)
    assert isinstance(finished, RunFinished)
    event = build_event(EventType.RUN_FINISHED, source="/t", data=finished)
    emitted = await planner.handle(event, Trust.OBSERVED)
    scheduled = [parse_payload(e) for e in emitted]
    [deadline] = [p.deadline for p in scheduled if getattr(p, "target", None) is Target.KUBERNETES]  # type: ignore[union-attr]
    assert deadline == finished_at.replace(microsecond=0) + timedelta(seconds=60)
    due = CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=deadline,
        policy="argo:ttlStrategy.secondsAfterSuccess",
        scheduled_at=finished_at,
    )
    event = build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=due)
    result = outcome(await stage.reaper().handle(event))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.DELETED
    assert await stage.kube.workflows.get(ns, "from-template") is None


async def planned(stage: Stage, spec: KindSpec, obj: dict[str, Any]) -> CleanupDue:
    """What the planner schedules for `obj` (read by lapse itself), as its due event."""
    finished = adapt(obj, spec)
    assert isinstance(finished, RunFinished), finished
    event = build_event(EventType.RUN_FINISHED, source="/test", data=finished)
    emitted = [parse_payload(e) for e in await stage.planner().handle(event, Trust.OBSERVED)]
    [scheduled] = [
        p for p in emitted if isinstance(p, CleanupScheduled) and p.target is Target.KUBERNETES
    ]
    return CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=scheduled.deadline,
        policy=scheduled.policy,
        scheduled_at=finished.run.finished_at,
    )


@pytest.mark.parametrize("name", list(ENGINE_TTL_KINDS))
async def test_an_opt_in_kind_is_deleted_at_its_engines_own_ttl_and_not_before(
    stage: Stage, name: str
) -> None:
    """No lapse annotation and no policy: the engine's own TTL field decides, counted from
    the finish time its own controller counts from (finished 20 minutes ago here)."""
    spec = KINDS[name]
    ns = stage.kube.namespace(f"{PREFIX}{name}-engine-ttl")
    expired = await stage.finished(spec, ns, "expired", ttl=None, ttl_seconds=600)
    due = await planned(stage, spec, expired)
    assert due.policy == ENGINE_TTL_KINDS[name]
    assert due.run.finished_at is not None
    assert due.deadline == due.run.finished_at + timedelta(seconds=600)
    event = build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=due)
    deleted = outcome(await stage.reaper().handle(event))
    assert isinstance(deleted, CleanupCompleted) and deleted.outcome is Outcome.DELETED, deleted
    assert not await stage.exists(spec, expired)

    # An hour's TTL has 40 minutes to go: a due event that says otherwise deletes nothing.
    young = await stage.finished(spec, ns, "young", ttl=None, ttl_seconds=3600)
    due = await planned(stage, spec, young)
    assert due.run.finished_at is not None
    assert due.deadline == due.run.finished_at + timedelta(hours=1)
    early = due.model_copy(update={"deadline": due.run.finished_at})
    event = build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=early)
    result = outcome(await stage.reaper().handle(event))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.RESCHEDULED, result
    assert await stage.exists(spec, young)


@pytest.mark.parametrize("name", list(ENGINE_TTL_KINDS))
async def test_an_unfinished_opt_in_kind_is_never_deleted(stage: Stage, name: str) -> None:
    """Planned when it looked finished, running again when its deadline came (a claim, or
    a re-run): the reaper reads it, finds it unfinished and keeps it."""
    spec = KINDS[name]
    ns = stage.kube.namespace(f"{PREFIX}{name}-running")
    obj = await stage.finished(spec, ns, "running", ttl_seconds=0)
    event = due_event(spec, obj)
    obj["status"] = MAKERS[name](ns, "running", done=False)[1]
    running = await stage.objects.replace_status(spec, ns, "running", obj)
    assert isinstance(adapt(running, spec), Ignored)
    result = outcome(await stage.reaper().handle(event))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.KEPT, result
    assert "not finished" in (result.detail or "")
    assert await stage.exists(spec, obj)


async def test_a_jobset_run_by_a_trainjob_is_left_to_the_trainjob(stage: Stage) -> None:
    """Kubeflow Trainer runs a TrainJob as a JobSet it controls: the JobSet is never
    planned, and a due event for it (forged, or from before the owner was set) keeps it."""
    ns = stage.kube.namespace(f"{PREFIX}jobset-owned")
    owner = await stage.finished(TRAINJOB, ns, "train")
    loose = await stage.finished(JOBSET, ns, "train", ttl_seconds=0)
    event = due_event(JOBSET, loose)
    loose["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "name": "train",
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    owned = await stage.objects.replace(JOBSET, ns, "train", loose)
    ignored = adapt(owned, JOBSET)
    assert isinstance(ignored, Ignored)
    assert "controlled by TrainJob/train" in ignored.reason
    result = outcome(await stage.reaper().handle(event))
    assert isinstance(result, CleanupCompleted) and result.outcome is Outcome.KEPT, result
    assert "left to its owner" in (result.detail or "")
    assert await stage.exists(JOBSET, owned)
