"""The normalized run reference: what every lapse event says about the run it concerns.

Engine adapters turn an Argo Workflow, a Tekton PipelineRun or a batch/v1 Job into this
shape, so nothing past the adapters needs to know which engine produced the run.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

KFP_RUN_ID_LABEL = "pipeline/runid"
KFP_PERSISTED_LABEL = "pipeline/persistedFinalState"
ARGO_ARCHIVING_LABEL = "workflows.argoproj.io/workflow-archiving-status"


class Engine(StrEnum):
    ARGO = "argo"
    TEKTON = "tekton"
    JOB = "job"
    TRAINER = "trainer"  # Kubeflow Trainer (TrainJob)
    OTHER = "other"  # a kind declared in lapse.yaml without an engine of its own


class Target(StrEnum):
    """What a deadline deletes: the Kubernetes object, the run's database rows, or its
    artifacts and logs in object storage (each on its own clock)."""

    KUBERNETES = "kubernetes"
    DATABASE = "database"
    ARTIFACTS = "artifacts"


class ContractModel(BaseModel):
    """Base for every payload: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


class ArgoTTLStrategy(ContractModel):
    """The engine's own TTL, in seconds: Argo's `ttlStrategy` as it is; a Job's
    `spec.ttlSecondsAfterFinished` as `secondsAfterCompletion` (any phase)."""

    seconds_after_completion: int | None = Field(default=None, ge=0)
    seconds_after_success: int | None = Field(default=None, ge=0)
    seconds_after_failure: int | None = Field(default=None, ge=0)


class RunRef(ContractModel):
    """One finished (or deleted) run, engine-agnostic.

    `phase` keeps the engine's own word (Argo: Succeeded/Failed/Error; Tekton and Jobs are
    mapped to Succeeded/Failed by their adapters) because Argo's TTL rules depend on it.
    """

    engine: Engine
    api_version: str
    kind: str
    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)
    uid: str = Field(min_length=1)
    resource_version: str | None = None
    phase: str
    finished_at: AwareDatetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    ttl_strategy: ArgoTTLStrategy | None = None
    kfp_run_id: str | None = None

    @property
    def subject(self) -> str:
        """The CloudEvents `subject` for this run: `<namespace>/<name>`."""
        return f"{self.namespace}/{self.name}"

    def finished_or(self, fallback: datetime) -> datetime:
        return self.finished_at if self.finished_at is not None else fallback
