"""Tekton PipelineRuns, as objects and as the CloudEvents the Tekton controller sends."""

from __future__ import annotations

from typing import Final

from events.adapters.kube import (
    as_object,
    check_type,
    child_object,
    condition,
    optional_str,
    read_metadata,
    run_ref,
    timestamp,
)
from events.adapters.result import Ignored
from events.errors import InvalidEvent
from events.models import RunDeleted, RunFinished
from events.run import Engine, RunRef

GROUP: Final = "tekton.dev"
KIND: Final = "PipelineRun"
# Tekton sends its objects converted to v1beta1 and often without TypeMeta; v1 is the
# version every supported Tekton serves and stores, so a reaper can always DELETE by it.
DEFAULT_API_VERSION: Final = "tekton.dev/v1"
RUNNING: Final = "Running"

EVENT_PREFIX: Final = "dev.tekton.event."
PIPELINERUN_SUCCESSFUL: Final = "dev.tekton.event.pipelinerun.successful.v1"
PIPELINERUN_FAILED: Final = "dev.tekton.event.pipelinerun.failed.v1"
_FINISHED_EVENTS: Final = {PIPELINERUN_SUCCESSFUL: "Succeeded", PIPELINERUN_FAILED: "Failed"}
_NOT_FINISHED_EVENTS: Final = frozenset(
    f"dev.tekton.event.pipelinerun.{state}.v1" for state in ("started", "running", "unknown")
)
# TaskRuns and CustomRuns inside a PipelineRun are garbage-collected with it.
_OTHER_RUN_PREFIXES: Final = ("dev.tekton.event.taskrun.", "dev.tekton.event.customrun.")


def adapt_pipelinerun(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """A PipelineRun object -> RunFinished (Succeeded condition final), RunDeleted, Ignored."""
    run = pipelinerun_ref(obj)
    if deleted:
        return RunDeleted(run=run)
    if run.phase == RUNNING:
        return Ignored(f"{KIND} {run.subject} has not finished (Succeeded condition not final)")
    return RunFinished(run=run)


def pipelinerun_ref(obj: object) -> RunRef:
    """Normalize a PipelineRun; phase Succeeded/Failed, or Running while not final.

    The `Succeeded` condition's True/False decides (cancelled and timed-out runs are
    False, hence Failed); `status.completionTime` is the finish.
    """
    pipeline_run = as_object(obj, KIND)
    api_version = check_type(pipeline_run, GROUP, KIND, DEFAULT_API_VERSION)
    meta = read_metadata(pipeline_run, KIND)
    where = f"{KIND} {meta.subject}"
    status = child_object(pipeline_run, "status", f"{where}: status")
    succeeded = condition(status, "Succeeded", where) or {}
    state = optional_str(succeeded, "status", f"{where}: Succeeded condition status")
    phase = {"True": "Succeeded", "False": "Failed"}.get(state or "", RUNNING)
    finished_at = None
    if phase != RUNNING:
        finished_at = timestamp(
            status, "completionTime", f"{where}: status.completionTime"
        ) or timestamp(
            succeeded, "lastTransitionTime", f"{where}: Succeeded condition lastTransitionTime"
        )
    return run_ref(
        engine=Engine.TEKTON,
        api_version=api_version,
        kind=KIND,
        meta=meta,
        phase=phase,
        finished_at=finished_at,
    )


def adapt_tekton_event(event_type: str, data: object) -> RunFinished | Ignored:
    """A `dev.tekton.event.*` CloudEvent, given its type and decoded data."""
    if event_type in _NOT_FINISHED_EVENTS or event_type.startswith(_OTHER_RUN_PREFIXES):
        return Ignored(f"{event_type} does not report a finished PipelineRun")
    expected = _FINISHED_EVENTS.get(event_type)
    if expected is None:
        raise InvalidEvent(f"unsupported Tekton event type {event_type!r}")
    body = as_object(data, f"{event_type} data")
    if body.get("pipelineRun") is None:
        raise InvalidEvent(f"{event_type} data has no pipelineRun")
    run = pipelinerun_ref(body["pipelineRun"])
    if run.phase != expected:
        raise InvalidEvent(f"{event_type} carries {KIND} {run.subject} in phase {run.phase}")
    return RunFinished(run=run)
