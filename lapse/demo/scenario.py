"""The tour's script: which sample runs exist, how each one expires, and lapse's config.

Every way a run can get its Kubernetes deadline appears in each run of eight samples:
a `lapse.dev/ttl` annotation, Argo's `spec.ttlStrategy` on a Succeeded and on a Failed
run, `lapse.dev/keep`, KFP runs whose object and rows follow the admin's policy on two
separate clocks, and runs of two other engines: a Tekton PipelineRun (`lapse.dev/ttl`) and
a batch/v1 Job (its own `spec.ttlSecondsAfterFinished`). TTLs stay short (at most
`MAX_TTL` seconds): the tour takes about 20 s.

Beside them, one KFP run with its whole footprint (`footprint_sample`): its Workflow, its
KFP rows, its ML Metadata rows and its artifacts in the embedded S3 server, each part on
its own clock (object, then rows and metadata on the database clock, then artifacts).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import yaml

from lapse.events.adapters import argo
from lapse.events.kinds import ARGO_WORKFLOW, JOB, TEKTON_PIPELINERUN, KindSpec
from lapse.events.run import KFP_PERSISTED_LABEL, KFP_RUN_ID_LABEL
from lapse.events.timeutil import format_rfc3339
from lapse.functions.policy import KEEP_ANNOTATION, TTL_ANNOTATION

NAMESPACE: Final = "lapse-demo"
POLICY_NAME: Final = "kfp-runs"
# The admin's two clocks for KFP runs: the object goes soon, its rows live longer.
KFP_OBJECT_TTL: Final = 6
KFP_ROWS_TTL: Final = 15
# What the KFP SDK's `ttl_seconds_after_finished` compiles into (Argo's ttlStrategy).
KFP_SDK_TTL: Final = 9
KEPT_TTL: Final = 4  # the annotation `keep` overrides; shown to prove it is ignored
MAX_TTL: Final = 20
# The footprint run's three clocks (its metadata rows go on the database clock).
FOOTPRINT_POLICY: Final = "kfp-footprint"
FOOTPRINT_OBJECT_TTL: Final = 4
FOOTPRINT_ROWS_TTL: Final = 10
FOOTPRINT_ARTIFACTS_TTL: Final = 16
# KFP's default pipeline root is minio://mlpipeline/v2/artifacts; a run's outputs are under
# <pipeline name>/<run id>/ there. The pipeline name is a label the demo's pipeline sets.
PIPELINE_NAME_LABEL: Final = "pipeline-name"
PIPELINE_NAME: Final = "train"
ARTIFACT_BUCKET: Final = "mlpipeline"
ARTIFACT_ROOT: Final = "v2/artifacts/"
ARTIFACT_STORE: Final = "pipeline-root"


class Kind(StrEnum):
    TTL = "ttl"
    ARGO_SUCCEEDED = "argo-ok"
    ARGO_FAILED = "argo-failed"
    KEEP = "keep"
    KFP = "kfp"
    TEKTON = "tekton"
    JOB = "job"
    FOOTPRINT = "kfp-footprint"


# One of each way to expire per eight runs.
CYCLE: Final = (
    Kind.TTL,
    Kind.KFP,
    Kind.ARGO_SUCCEEDED,
    Kind.TEKTON,
    Kind.ARGO_FAILED,
    Kind.KFP,
    Kind.KEEP,
    Kind.JOB,
)
# The engines' own samples, and what the tour's run objects are.
RUN_KINDS: Final = (ARGO_WORKFLOW, TEKTON_PIPELINERUN, JOB)


@dataclass(frozen=True)
class Sample:
    """One workflow the tour creates, and what lapse is expected to do with it."""

    name: str
    kind: Kind
    phase: str
    object_ttl: int  # seconds after finishing; for a kept run, the TTL keep overrides
    hint: str  # how the run asks to expire, in the words of its own fields
    rows_ttl: int | None = None  # None: the run has no database rows
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    ttl_strategy: Mapping[str, int] | None = None
    run_kind: KindSpec = ARGO_WORKFLOW
    artifacts_ttl: int | None = None  # None: no artifacts of its own in the S3 server

    @property
    def kept(self) -> bool:
        return self.kind is Kind.KEEP

    @property
    def kfp_run_id(self) -> str | None:
        return self.labels.get(KFP_RUN_ID_LABEL)


def make_samples(count: int) -> list[Sample]:
    seen: dict[Kind, int] = {}
    samples = []
    for index in range(count):
        kind = CYCLE[index % len(CYCLE)]
        nth = seen[kind] = seen.get(kind, -1) + 1
        samples.append(_sample(f"{kind.value}-{index:02d}", kind, nth))
    return samples


def footprint_sample(*, with_artifacts: bool) -> Sample:
    """The KFP run whose whole footprint goes, each part on its own clock."""
    labels = {
        KFP_RUN_ID_LABEL: str(uuid.uuid4()),
        KFP_PERSISTED_LABEL: "true",
        PIPELINE_NAME_LABEL: PIPELINE_NAME,
    }
    hint = f"KFP: policy {FOOTPRINT_POLICY}"
    return Sample(
        Kind.FOOTPRINT.value, Kind.FOOTPRINT, "Succeeded", FOOTPRINT_OBJECT_TTL, hint,
        FOOTPRINT_ROWS_TTL, labels=labels,
        artifacts_ttl=FOOTPRINT_ARTIFACTS_TTL if with_artifacts else None,
    )  # fmt: skip


def artifact_prefix(sample: Sample) -> str:
    """Where KFP writes the run's outputs in its pipeline root (the bucket's key)."""
    return f"{ARTIFACT_ROOT}{PIPELINE_NAME}/{sample.kfp_run_id}/"


def _sample(name: str, kind: Kind, nth: int) -> Sample:
    if kind is Kind.TEKTON:
        ttl = 5 + (nth * 4) % 12
        annotations = {TTL_ANNOTATION: f"{ttl}s"}
        hint = f"PipelineRun, ttl {ttl}s"
        return Sample(
            name, kind, "Succeeded", ttl, hint, annotations=annotations,
            run_kind=TEKTON_PIPELINERUN,
        )  # fmt: skip
    if kind is Kind.JOB:
        ttl = 7 + (nth * 3) % 10
        hint = f"Job, ttlSecondsAfterFinished {ttl}"
        return Sample(name, kind, "Succeeded", ttl, hint, run_kind=JOB)
    if kind is Kind.TTL:
        ttl = 3 + (nth * 5) % (MAX_TTL - 2)  # 3, 8, 13, 18, 5, ...: deadlines spread out
        annotations = {TTL_ANNOTATION: f"{ttl}s"}
        return Sample(name, kind, "Succeeded", ttl, f"ttl {ttl}s", annotations=annotations)
    if kind in (Kind.ARGO_SUCCEEDED, Kind.ARGO_FAILED):
        success = 4 + (nth * 3) % 9
        # Both clocks set, so the Failed runs show Argo's rule picking the failure one.
        strategy = {"secondsAfterSuccess": success, "secondsAfterFailure": success + 6}
        if kind is Kind.ARGO_FAILED:
            ttl, hint = success + 6, f"ttlStrategy {success + 6}s after failure"
            return Sample(name, kind, "Failed", ttl, hint, ttl_strategy=strategy)
        hint = f"ttlStrategy {success}s after success"
        return Sample(name, kind, "Succeeded", success, hint, ttl_strategy=strategy)
    if kind is Kind.KEEP:
        annotations = {KEEP_ANNOTATION: "true", TTL_ANNOTATION: f"{KEPT_TTL}s"}
        hint = f"keep (overrides ttl {KEPT_TTL}s)"
        return Sample(name, kind, "Succeeded", KEPT_TTL, hint, annotations=annotations)
    labels = {KFP_RUN_ID_LABEL: str(uuid.uuid4()), KFP_PERSISTED_LABEL: "true"}
    # Half the KFP runs were compiled with a TTL (object only), half rely on the policy.
    if nth % 2:
        strategy = {"secondsAfterCompletion": KFP_SDK_TTL}
        hint = f"KFP: ttlStrategy {KFP_SDK_TTL}s, rows by policy"
        return Sample(
            name, kind, "Succeeded", KFP_SDK_TTL, hint, KFP_ROWS_TTL, labels=labels,
            ttl_strategy=strategy,
        )  # fmt: skip
    hint = f"KFP: policy {POLICY_NAME}"
    return Sample(name, kind, "Succeeded", KFP_OBJECT_TTL, hint, KFP_ROWS_TTL, labels=labels)


def run_object(sample: Sample, finished_at: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sample's object as its engine's controller leaves it when the run ends, and its
    status. No controller runs in the demo; these are exactly the fields lapse reads.
    Workflows carry their status in the body (Argo's CRD has no status subresource); the
    other kinds' status is written through the status subresource after the create."""
    if sample.run_kind is ARGO_WORKFLOW:
        body = workflow(sample, finished_at)
        return body, body["status"]
    stamp = format_rfc3339(finished_at.replace(microsecond=0))
    metadata = {"name": sample.name, "annotations": dict(sample.annotations)}
    if sample.run_kind is TEKTON_PIPELINERUN:
        succeeded = {
            "type": "Succeeded", "status": "True", "reason": "Succeeded",
            "message": "Tasks Completed: 2", "lastTransitionTime": stamp,
        }  # fmt: skip
        body = {
            "apiVersion": TEKTON_PIPELINERUN.api_version,
            "kind": TEKTON_PIPELINERUN.kind,
            "metadata": metadata,
            "spec": {"pipelineRef": {"name": "build-and-test"}},
        }
        return body, {"startTime": stamp, "completionTime": stamp, "conditions": [succeeded]}
    body = {
        "apiVersion": JOB.api_version,
        "kind": JOB.kind,
        "metadata": metadata,
        "spec": {
            "ttlSecondsAfterFinished": sample.object_ttl,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "report", "image": "registry.invalid/report:1"}],
                }
            },
        },
    }
    # As the Job controller of Kubernetes v1.35 writes a succeeded Job's status (the demo's
    # own copy; tests/e2e/test_demo.py holds it to the recording in tests/fixtures/engines/).
    conditions = [
        {
            "type": kind, "status": "True", "reason": "CompletionsReached",
            "message": "Reached expected number of succeeded pods",
            "lastProbeTime": stamp, "lastTransitionTime": stamp,
        }
        for kind in ("SuccessCriteriaMet", "Complete")
    ]  # fmt: skip
    status = {
        "startTime": stamp, "completionTime": stamp, "succeeded": 1, "ready": 0,
        "terminating": 0, "uncountedTerminatedPods": {}, "conditions": conditions,
    }  # fmt: skip
    return body, status


def workflow(sample: Sample, finished_at: datetime) -> dict[str, Any]:
    """The Workflow as Argo leaves it when the run ends; no controller runs in the demo, and
    these are exactly the fields lapse reads."""
    stamp = format_rfc3339(finished_at.replace(microsecond=0))
    spec: dict[str, Any] = {"entrypoint": "main", "templates": [{"name": "main"}]}
    if sample.ttl_strategy is not None:
        spec["ttlStrategy"] = dict(sample.ttl_strategy)
    return {
        "apiVersion": argo.DEFAULT_API_VERSION,
        "kind": argo.KIND,
        "metadata": {
            "name": sample.name,
            "labels": {
                argo.COMPLETED_LABEL: "true",
                "workflows.argoproj.io/phase": sample.phase,
                **sample.labels,
            },
            "annotations": dict(sample.annotations),
        },
        "spec": spec,
        "status": {"phase": sample.phase, "startedAt": stamp, "finishedAt": stamp},
    }


def write_config(
    path: Path,
    *,
    nats_url: str,
    kubeconfig: Path,
    database_url: str,
    s3_endpoint: str | None = None,
    s3_region: str = "us-east-1",
) -> Path:
    """lapse's configuration for the tour: what an admin of a KFP installation would write.
    With an S3 endpoint, KFP's pipeline root there is an artifacts store (its credentials
    are in the environment, never here)."""
    footprint: dict[str, Any] = {
        "name": FOOTPRINT_POLICY,
        "match": {"has_labels": [PIPELINE_NAME_LABEL]},
        "kubernetes": {"ttl": f"{FOOTPRINT_OBJECT_TTL}s"},
        "database": {"ttl": f"{FOOTPRINT_ROWS_TTL}s"},
    }
    config: dict[str, Any] = {
        "nats": {"url": nats_url},
        "kubernetes": {"kubeconfig": str(kubeconfig)},
        "database": {
            "url": database_url,
            "targets": {"kfp": {"enabled": True}, "ml_metadata": {"enabled": True}},
        },
        "policies": [
            footprint,
            {
                "name": POLICY_NAME,
                "match": {"has_labels": [KFP_RUN_ID_LABEL]},
                "kubernetes": {"ttl": f"{KFP_OBJECT_TTL}s"},
                "database": {"ttl": f"{KFP_ROWS_TTL}s"},
            },
        ],
        # Every KFP run comes due in the same second: let them all through at once.
        "safety": {"max_deletions_per_second": 200},
    }
    if s3_endpoint is not None:
        footprint["artifacts"] = {"ttl": f"{FOOTPRINT_ARTIFACTS_TTL}s"}
        config["artifacts"] = {
            "stores": [
                {
                    "name": ARTIFACT_STORE,
                    "url": f"s3://{ARTIFACT_BUCKET}/{ARTIFACT_ROOT}",
                    "endpoint": s3_endpoint,
                    "region": s3_region,
                    # v2/artifacts/<pipeline>/<run id>/: nothing shallower is ever deleted.
                    "min_prefix_depth": 4,
                    # KFP's layout names no namespace: the demo namespace's own root.
                    "namespaces": [NAMESPACE],
                    "roots": [""],
                    "capture": {"argo-workflow": [f"{{label:{PIPELINE_NAME_LABEL}}}/{{run_id}}/"]},
                }
            ]
        }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
