"""Tekton PipelineRuns and TaskRuns, as objects and as the CloudEvents the Tekton
controller sends (`dev.tekton.event.<pipelinerun|taskrun>.<state>.v1`, data
`{"pipelineRun": {...}}` or `{"taskRun": {...}}`)."""

from __future__ import annotations

from typing import Final

from lapse.events.adapters.kube import as_object
from lapse.events.adapters.objects import adapt, read_run
from lapse.events.adapters.result import Ignored
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import DEFAULT_KINDS, TEKTON_PIPELINERUN, TEKTON_TASKRUN, KindSet
from lapse.events.models import RunDeleted, RunFinished
from lapse.events.run import RunRef

GROUP: Final = TEKTON_PIPELINERUN.group
KIND: Final = TEKTON_PIPELINERUN.kind
# Tekton sends its objects converted to v1beta1 and often without TypeMeta; v1 is the
# version every supported Tekton serves and stores, so a reaper can always DELETE by it.
DEFAULT_API_VERSION: Final = TEKTON_PIPELINERUN.api_version

EVENT_PREFIX: Final = "dev.tekton.event."
PIPELINERUN_SUCCESSFUL: Final = "dev.tekton.event.pipelinerun.successful.v1"
PIPELINERUN_FAILED: Final = "dev.tekton.event.pipelinerun.failed.v1"
TASKRUN_SUCCESSFUL: Final = "dev.tekton.event.taskrun.successful.v1"
TASKRUN_FAILED: Final = "dev.tekton.event.taskrun.failed.v1"
# event type -> (data key, kind, the phase the event reports)
_FINISHED_EVENTS: Final = {
    PIPELINERUN_SUCCESSFUL: ("pipelineRun", TEKTON_PIPELINERUN.kind, "Succeeded"),
    PIPELINERUN_FAILED: ("pipelineRun", TEKTON_PIPELINERUN.kind, "Failed"),
    TASKRUN_SUCCESSFUL: ("taskRun", TEKTON_TASKRUN.kind, "Succeeded"),
    TASKRUN_FAILED: ("taskRun", TEKTON_TASKRUN.kind, "Failed"),
}
_NOT_FINISHED_EVENTS: Final = frozenset(
    f"dev.tekton.event.{run}.{state}.v1"
    for run in ("pipelinerun", "taskrun")
    for state in ("started", "running", "unknown")
)
# CustomRuns are the business of the controller that runs them.
_OTHER_PREFIXES: Final = ("dev.tekton.event.customrun.",)


def adapt_pipelinerun(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """A PipelineRun object -> RunFinished (Succeeded condition final), RunDeleted, Ignored."""
    return adapt(obj, TEKTON_PIPELINERUN, deleted)


def pipelinerun_ref(obj: object) -> RunRef:
    """Normalize a PipelineRun; phase Succeeded/Failed, or Running while not final."""
    return read_run(obj, TEKTON_PIPELINERUN)[0]


def adapt_tekton_event(
    event_type: str, data: object, kinds: KindSet = DEFAULT_KINDS
) -> RunFinished | Ignored:
    """A `dev.tekton.event.*` CloudEvent, given its type and decoded data."""
    if event_type in _NOT_FINISHED_EVENTS or event_type.startswith(_OTHER_PREFIXES):
        return Ignored(f"{event_type} does not report a finished run")
    if event_type not in _FINISHED_EVENTS:
        raise InvalidEvent(f"unsupported Tekton event type {event_type!r}")
    key, kind, expected = _FINISHED_EVENTS[event_type]
    spec = kinds.find(DEFAULT_API_VERSION, kind)
    if spec is None:
        return Ignored(f"{event_type}: {kind} is not one of lapse's configured kinds")
    body = as_object(data, f"{event_type} data")
    if body.get(key) is None:
        raise InvalidEvent(f"{event_type} data has no {key}")
    run, _ = read_run(body[key], spec)
    if run.phase != expected:
        raise InvalidEvent(f"{event_type} carries {kind} {run.subject} in phase {run.phase}")
    result = adapt(body[key], spec)  # Ignored when a PipelineRun controls this TaskRun
    assert not isinstance(result, RunDeleted)
    return result
