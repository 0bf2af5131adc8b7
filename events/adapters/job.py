"""Kubernetes batch/v1 Jobs."""

from __future__ import annotations

from typing import Final

from events.adapters.kube import (
    as_object,
    check_type,
    child_list,
    child_object,
    read_metadata,
    run_ref,
    timestamp,
)
from events.adapters.result import Ignored
from events.models import RunDeleted, RunFinished
from events.run import Engine

GROUP: Final = "batch"
KIND: Final = "Job"
DEFAULT_API_VERSION: Final = "batch/v1"
# SuccessCriteriaMet and FailureTarget (Kubernetes 1.31+) come first, while pods may still
# be terminating; only Complete/Failed mean the Job is done (as for the TTL controller).
_FINISHED: Final = {"Complete": "Succeeded", "Failed": "Failed"}


def adapt_job(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """A Job object -> RunFinished (Complete/Failed condition True), RunDeleted, Ignored.

    The finishing condition's `lastTransitionTime` is the finish (what the Kubernetes
    TTL-after-finished controller counts from); `status.completionTime` if it is absent.
    """
    job = as_object(obj, KIND)
    api_version = check_type(job, GROUP, KIND, DEFAULT_API_VERSION)
    meta = read_metadata(job, KIND)
    where = f"{KIND} {meta.subject}"
    status = child_object(job, "status", f"{where}: status")
    phase, finished_at = "Running", None
    for index, item in enumerate(child_list(status, "conditions", f"{where}: status.conditions")):
        entry = as_object(item, f"{where}: status.conditions[{index}]")
        condition_type = entry.get("type")
        mapped = _FINISHED.get(condition_type) if isinstance(condition_type, str) else None
        if mapped is not None and entry.get("status") == "True":
            phase = mapped
            finished_at = timestamp(
                entry, "lastTransitionTime", f"{where}: status.conditions[{index}]"
            ) or timestamp(status, "completionTime", f"{where}: status.completionTime")
            break
    run = run_ref(
        engine=Engine.JOB,
        api_version=api_version,
        kind=KIND,
        meta=meta,
        phase=phase,
        finished_at=finished_at,
    )
    if deleted:
        return RunDeleted(run=run)
    if phase == "Running":
        return Ignored(f"{where} has not finished (no Complete or Failed condition)")
    return RunFinished(run=run)
