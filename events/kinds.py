"""Which kinds of Kubernetes objects lapse plans and deletes, and how each one is read.

A kind is data, not code: its group/version/resource, how "finished" and the finish time
are read from the object, the engine's own TTL field, the gates that must be open before
a deletion, and whether objects controlled by another object are left to their owner.
`BUILTIN_KINDS` describes Argo Workflows, Tekton PipelineRuns and TaskRuns, batch/v1 Jobs,
Kubeflow Trainer TrainJobs, KubeRay RayJobs, JobSets and Spark Operator SparkApplications;
`lapse.yaml`'s `kinds` section picks among them (without it: `DEFAULT_KIND_NAMES`, which
leaves out the last three) and may declare more (docs/architecture.md, "Kinds"). Adding a
kind is configuration, plus at most one small engine-TTL reader in
events/adapters/objects.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from lapse.events.run import Engine


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _field_path(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(\.[A-Za-z][A-Za-z0-9]*)*", value):
        raise ValueError(f"{value!r} is not a field path such as status.completionTime")
    return value


FieldPath = Annotated[str, AfterValidator(_field_path)]
# Where the finish time is read, first present wins: a field path, or `condition` for the
# `lastTransitionTime` of the condition that said the object finished.
FinishSource = FieldPath | Literal["condition"]
CONDITION: Final = "condition"


class ByPhase(_Model):
    """Finished when a phase field holds one of `phases` (Argo: status.phase). The phase
    is kept as the engine says it (Argo's TTL rules tell Failed from Error) unless it is
    listed in `succeeded` or `failed`: an engine whose words are not Succeeded/Failed
    (KubeRay's Complete, Spark's COMPLETED) is read as them, so that a policy's
    after_success/after_failure clock applies to it."""

    field: FieldPath = "status.phase"
    phases: tuple[str, ...] = Field(min_length=1)
    at: tuple[FieldPath, ...] = ("status.finishedAt",)
    succeeded: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _mapped_phases_are_finished(self) -> ByPhase:
        stray = [p for p in (*self.succeeded, *self.failed) if p not in self.phases]
        if stray:
            raise ValueError(f"succeeded/failed name phases not in phases: {', '.join(stray)}")
        if set(self.succeeded) & set(self.failed):
            raise ValueError("a phase cannot be both succeeded and failed")
        return self

    def reported(self, phase: str) -> str:
        """The finished `phase` as lapse reports it (RunRef.phase)."""
        if phase in self.succeeded:
            return "Succeeded"
        if phase in self.failed:
            return "Failed"
        return phase


class Condition(_Model):
    """One status condition that means "finished": `type` with `status`, read as `phase`."""

    type: str = Field(min_length=1)
    status: Literal["True", "False"] = "True"
    phase: Literal["Succeeded", "Failed"]


class ByConditions(_Model):
    """Finished when one of these conditions holds (the Kubernetes conditions convention:
    Jobs, Tekton runs, TrainJobs); the first listed that holds gives the phase."""

    conditions: tuple[Condition, ...] = Field(min_length=1)
    at: tuple[FinishSource, ...] = (CONDITION,)


class EngineTTL(StrEnum):
    """The engine's own TTL field, honoured like a `lapse.dev/ttl` annotation."""

    NONE = "none"
    # spec.ttlStrategy, else status.storedWorkflowTemplateSpec.ttlStrategy (a Workflow
    # submitted from a WorkflowTemplate), exactly as Argo's own GC reads it.
    ARGO = "argo"
    # spec.ttlSecondsAfterFinished counted from the Complete/Failed (JobSet: Completed/
    # Failed) condition's lastTransitionTime: a batch/v1 Job's, the same deadline the
    # Kubernetes TTL-after-finished controller keeps, and a JobSet's, the same one the
    # JobSet controller keeps (ttl_after_finished.go); whichever deletes first, the other
    # finds it gone.
    JOB = "job"
    # KubeRay's spec.ttlSecondsAfterFinished, counted from status.endTime, and only when
    # spec.shutdownAfterJobFinishes is true and no clusterSelector is set: the cases in
    # which KubeRay's own controller acts on it (rayjob_controller.go).
    RAY = "ray"
    # The Spark Operator's spec.timeToLiveSeconds, counted from status.terminationTime.
    SPARK = "spark"

    @property
    def field(self) -> str | None:
        """The field the engine's TTL is read from (names it in `plan` and `history`)."""
        return _ENGINE_TTL_FIELDS.get(self)


_ENGINE_TTL_FIELDS: Final = {
    EngineTTL.ARGO: "spec.ttlStrategy",
    EngineTTL.JOB: "spec.ttlSecondsAfterFinished",
    EngineTTL.RAY: "spec.ttlSecondsAfterFinished",
    EngineTTL.SPARK: "spec.timeToLiveSeconds",
}


class Gate(StrEnum):
    """Conditions under which an expired object must not be deleted yet (see gates.py of
    the object reaper)."""

    ARGO_ARCHIVING = "argo-archiving"
    KFP_PERSISTED = "kfp-persisted-final-state"
    # A PipelineRun is final while its TaskRuns may still be cancelling: wait for them.
    TEKTON_TASKRUNS = "tekton-taskruns-finished"
    # Tekton Results' watcher has not stored the run's final state yet.
    TEKTON_RESULTS_STORED = "tekton-results-stored"


Propagation = Literal["Background", "Foreground", "Orphan"]
_NAME = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"


def _kind_name(value: str) -> str:
    if not re.fullmatch(_NAME, value):
        raise ValueError(f"{value!r} is not a kind name (lower case, digits and '-')")
    return value


def _api_version(value: str) -> str:
    group, _, version = value.rpartition("/")
    if not group or not version:
        raise ValueError(
            f"{value!r}: lapse deletes objects of API groups (group/version, e.g. batch/v1)"
        )
    return value


class KindSpec(_Model):
    """One kind of run object lapse plans and deletes."""

    name: Annotated[str, AfterValidator(_kind_name)]
    api_version: Annotated[str, AfterValidator(_api_version)]
    kind: str = Field(min_length=1)
    # The plural resource name in the URL (`kubectl api-resources`).
    resource: str = Field(pattern=_NAME)
    engine: Engine = Engine.OTHER
    finished: ByPhase | ByConditions
    # A label selector that selects only finished objects, server-side: watches and lists
    # then never carry running work. Without one lapse lists and watches every object of
    # the kind and ignores the unfinished (see docs/architecture.md, "Kinds").
    finished_selector: str | None = None
    engine_ttl: EngineTTL = EngineTTL.NONE
    gates: tuple[Gate, ...] = ()
    # An object with a controlling owner (ownerReferences[].controller) is left to it: a
    # TaskRun goes with its PipelineRun, a Job with its CronJob's history limit.
    skip_controlled: bool = False
    # How dependents go (DeleteOptions.propagationPolicy); unset: kubernetes.propagation_policy
    # (default Background). Never leave a Job's at the API's own default for Jobs, which
    # orphans their Pods: Background has the garbage collector delete them.
    propagation: Propagation | None = None

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def describe(self) -> str:
        return f"{self.kind} ({self.resource}.{self.group})"


def _phase(*phases: str) -> ByPhase:
    return ByPhase(phases=phases)


_SUCCEEDED = (
    Condition(type="Succeeded", status="True", phase="Succeeded"),
    Condition(type="Succeeded", status="False", phase="Failed"),
)
_COMPLETE_OR_FAILED = (
    Condition(type="Complete", phase="Succeeded"),
    Condition(type="Failed", phase="Failed"),
)

ARGO_WORKFLOW: Final = KindSpec(
    name="argo-workflow",
    api_version="argoproj.io/v1alpha1",
    kind="Workflow",
    resource="workflows",
    engine=Engine.ARGO,
    finished=_phase("Succeeded", "Failed", "Error"),
    # Argo labels a Workflow completed=true when it reaches a terminal phase.
    finished_selector="workflows.argoproj.io/completed=true",
    engine_ttl=EngineTTL.ARGO,
    gates=(Gate.ARGO_ARCHIVING, Gate.KFP_PERSISTED),
)
TEKTON_PIPELINERUN: Final = KindSpec(
    name="tekton-pipelinerun",
    api_version="tekton.dev/v1",
    kind="PipelineRun",
    resource="pipelineruns",
    engine=Engine.TEKTON,
    # Cancelled and timed-out runs are Succeeded=False, hence Failed.
    finished=ByConditions(conditions=_SUCCEEDED, at=("status.completionTime", CONDITION)),
    gates=(Gate.TEKTON_TASKRUNS, Gate.TEKTON_RESULTS_STORED),
)
TEKTON_TASKRUN: Final = KindSpec(
    name="tekton-taskrun",
    api_version="tekton.dev/v1",
    kind="TaskRun",
    resource="taskruns",
    engine=Engine.TEKTON,
    finished=ByConditions(conditions=_SUCCEEDED, at=("status.completionTime", CONDITION)),
    gates=(Gate.TEKTON_RESULTS_STORED,),
    skip_controlled=True,
)
JOB: Final = KindSpec(
    name="job",
    api_version="batch/v1",
    kind="Job",
    resource="jobs",
    engine=Engine.JOB,
    # SuccessCriteriaMet and FailureTarget come first, while Pods may still terminate; only
    # Complete/Failed mean done, and their lastTransitionTime is what the Kubernetes TTL
    # controller counts from.
    finished=ByConditions(conditions=_COMPLETE_OR_FAILED, at=(CONDITION, "status.completionTime")),
    engine_ttl=EngineTTL.JOB,
    skip_controlled=True,
)
TRAINJOB: Final = KindSpec(
    name="trainjob",
    api_version="trainer.kubeflow.org/v1alpha1",
    kind="TrainJob",
    resource="trainjobs",
    engine=Engine.TRAINER,
    # KEP-2170: Complete or Failed (metav1.Condition, True) is terminal.
    finished=ByConditions(conditions=_COMPLETE_OR_FAILED),
)

RAYJOB: Final = KindSpec(
    name="rayjob",
    api_version="ray.io/v1",
    kind="RayJob",
    resource="rayjobs",
    # KubeRay's IsJobDeploymentTerminal: Complete (the Ray job SUCCEEDED or was STOPPED)
    # and Failed only. ValidationFailed, Suspended and Retrying are not terminal there (a
    # fixed or resumed RayJob runs again), so neither are they here. status.endTime is set
    # when jobDeploymentStatus turns Complete/Failed; KubeRay's own TTL counts from it.
    finished=ByPhase(
        field="status.jobDeploymentStatus",
        phases=("Complete", "Failed"),
        succeeded=("Complete",),
        failed=("Failed",),
        at=("status.endTime",),
    ),
    engine_ttl=EngineTTL.RAY,
    # Kueue owns a RayJob's Workload, not the RayJob (deleting the RayJob takes its
    # Workload, RayCluster and submitter Job with it). A RayJob that is itself controlled
    # (a workflow engine's step, e.g. Flyte's) lives and goes with that owner.
    skip_controlled=True,
)
JOBSET: Final = KindSpec(
    name="jobset",
    api_version="jobset.x-k8s.io/v1alpha2",
    kind="JobSet",
    resource="jobsets",
    # The JobSet controller's jobSetFinished: Completed or Failed, status True; its TTL
    # counts from that condition's lastTransitionTime (jobSetFinishTime).
    finished=ByConditions(
        conditions=(
            Condition(type="Completed", phase="Succeeded"),
            Condition(type="Failed", phase="Failed"),
        )
    ),
    engine_ttl=EngineTTL.JOB,
    # Kubeflow Trainer runs each TrainJob as a JobSet it controls: the TrainJob decides.
    skip_controlled=True,
)
SPARK_APPLICATION: Final = KindSpec(
    name="sparkapplication",
    api_version="sparkoperator.k8s.io/v1beta2",
    kind="SparkApplication",
    resource="sparkapplications",
    # The operator's IsTerminated: COMPLETED or FAILED. SUBMISSION_FAILED, FAILING and
    # SUCCEEDING still move on (a retry, or to FAILED/COMPLETED with terminationTime set).
    finished=ByPhase(
        field="status.applicationState.state",
        phases=("COMPLETED", "FAILED"),
        succeeded=("COMPLETED",),
        failed=("FAILED",),
        at=("status.terminationTime",),
    ),
    engine_ttl=EngineTTL.SPARK,
    # A controlling owner decides (a ScheduledSparkApplication's own runs carry an owner
    # reference without `controller`, so they are lapse's: see docs/architecture.md).
    skip_controlled=True,
)

BUILTIN_KINDS: Final[dict[str, KindSpec]] = {
    spec.name: spec
    for spec in (
        ARGO_WORKFLOW,
        TEKTON_PIPELINERUN,
        TEKTON_TASKRUN,
        JOB,
        TRAINJOB,
        RAYJOB,
        JOBSET,
        SPARK_APPLICATION,
    )
}
# What lapse plans and deletes when `lapse.yaml` has no `kinds`. RayJobs, JobSets and
# SparkApplications are opt-in: on upgrade lapse must not start deleting objects it never
# touched before (a RayJob with shutdownAfterJobFinishes and KubeRay's default TTL of 0
# would go the moment it finished), and on a cluster without their CRDs each default
# kind costs a discovery request a minute for ever.
DEFAULT_KIND_NAMES: Final = (
    "argo-workflow",
    "tekton-pipelinerun",
    "tekton-taskrun",
    "job",
    "trainjob",
)


def engine_ttl_field(api_version: str, kind: str) -> str:
    """The engine-TTL field of a built-in kind, as `plan` and `history` name it; a
    declared kind's engine TTL is the Job's field (`engine_ttl: job`)."""
    group = api_version.rpartition("/")[0]
    for spec in BUILTIN_KINDS.values():
        if (spec.group, spec.kind) == (group, kind) and spec.engine_ttl.field is not None:
            return spec.engine_ttl.field
    return "spec.ttlSecondsAfterFinished"


class UnknownKind(LookupError):
    """An object of a kind lapse is not configured for."""


class KindSet:
    """The configured kinds, found by name or by (API group, kind)."""

    def __init__(self, specs: Iterable[KindSpec]) -> None:
        self._specs = tuple(specs)
        self._by_group_kind: dict[tuple[str, str], KindSpec] = {}
        names: set[str] = set()
        for spec in self._specs:
            key = (spec.group, spec.kind)
            if spec.name in names:
                raise ValueError(f"kinds: the name {spec.name!r} is used twice")
            if key in self._by_group_kind:
                raise ValueError(f"kinds: {spec.kind} of {spec.group} is declared twice")
            names.add(spec.name)
            self._by_group_kind[key] = spec

    def __iter__(self) -> Iterator[KindSpec]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"KindSet({', '.join(s.name for s in self._specs)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KindSet) and self._specs == other._specs

    def __hash__(self) -> int:
        return hash(self._specs)

    def names(self) -> list[str]:
        return [spec.name for spec in self._specs]

    def named(self, name: str) -> KindSpec:
        for spec in self._specs:
            if spec.name == name:
                return spec
        raise UnknownKind(f"no kind named {name!r} (configured: {', '.join(self.names())})")

    def find(self, api_version: str, kind: str) -> KindSpec | None:
        return self._by_group_kind.get((api_version.rpartition("/")[0], kind))

    def of(self, api_version: str, kind: str) -> KindSpec:
        """The spec for an object's apiVersion and kind; `UnknownKind` says why not."""
        spec = self.find(api_version, kind)
        if spec is None:
            configured = ", ".join(s.describe() for s in self._specs) or "none"
            raise UnknownKind(
                f"{kind} of {api_version.rpartition('/')[0] or 'the core group'} is not a kind "
                f"lapse is configured for (kinds: {configured})"
            )
        return spec


DEFAULT_KINDS: Final = KindSet(BUILTIN_KINDS[name] for name in DEFAULT_KIND_NAMES)


def resolve_kinds(entries: Iterable[str | KindSpec]) -> KindSet:
    """`kinds:` entries -> a KindSet; a string names a built-in kind."""
    specs = []
    for entry in entries:
        if isinstance(entry, str):
            if entry not in BUILTIN_KINDS:
                known = ", ".join(BUILTIN_KINDS)
                raise ValueError(f"{entry!r} is not a built-in kind (built-in: {known})")
            specs.append(BUILTIN_KINDS[entry])
        else:
            specs.append(entry)
    return KindSet(specs)
