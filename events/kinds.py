"""Which kinds of Kubernetes objects lapse plans and deletes, and how each one is read.

A kind is data, not code: its group/version/resource, how "finished" and the finish time
are read from the object, the engine's own TTL field, the gates that must be open before
a deletion, and whether objects controlled by another object are left to their owner.
`BUILTIN_KINDS` describes Argo Workflows, Tekton PipelineRuns and TaskRuns, batch/v1 Jobs
and Kubeflow Trainer TrainJobs; `lapse.yaml`'s `kinds` section picks among them and may
declare more (docs/architecture.md, "Kinds"). Adding a kind is configuration, plus at
most one small engine-TTL reader in events/adapters/objects.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from events.run import Engine


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
    is kept as the engine says it, because Argo's TTL rules tell Failed from Error."""

    field: FieldPath = "status.phase"
    phases: tuple[str, ...] = Field(min_length=1)
    at: tuple[FieldPath, ...] = ("status.finishedAt",)


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
    # spec.ttlSecondsAfterFinished (batch/v1 Job): the same deadline the Kubernetes
    # TTL-after-finished controller keeps; whichever deletes first, the other finds it gone.
    JOB = "job"


class Gate(StrEnum):
    """Conditions under which an expired object must not be deleted yet (see gates.py of
    the object reaper)."""

    ARGO_ARCHIVING = "argo-archiving"
    KFP_PERSISTED = "kfp-persisted-final-state"
    # A PipelineRun is final while its TaskRuns may still be cancelling: wait for them.
    TEKTON_TASKRUNS = "tekton-taskruns-finished"


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
    gates=(Gate.TEKTON_TASKRUNS,),
)
TEKTON_TASKRUN: Final = KindSpec(
    name="tekton-taskrun",
    api_version="tekton.dev/v1",
    kind="TaskRun",
    resource="taskruns",
    engine=Engine.TEKTON,
    finished=ByConditions(conditions=_SUCCEEDED, at=("status.completionTime", CONDITION)),
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

BUILTIN_KINDS: Final[dict[str, KindSpec]] = {
    spec.name: spec for spec in (ARGO_WORKFLOW, TEKTON_PIPELINERUN, TEKTON_TASKRUN, JOB, TRAINJOB)
}


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


DEFAULT_KINDS: Final = KindSet(BUILTIN_KINDS.values())


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
