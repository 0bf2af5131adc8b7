"""Argo Workflows (including the ones Kubeflow Pipelines creates)."""

from __future__ import annotations

from typing import Any, Final

from pydantic import ValidationError

from events.adapters.kube import (
    as_object,
    check_type,
    child_object,
    json_kind,
    optional_str,
    read_metadata,
    run_ref,
    timestamp,
)
from events.adapters.result import Ignored
from events.errors import InvalidEvent, describe_validation_error
from events.models import RunDeleted, RunFinished
from events.run import ArgoTTLStrategy, Engine

GROUP: Final = "argoproj.io"
VERSION: Final = "v1alpha1"
KIND: Final = "Workflow"
RESOURCE: Final = "workflows"
DEFAULT_API_VERSION: Final = f"{GROUP}/{VERSION}"
# Argo sets this label to "true" when a Workflow reaches a terminal phase: selecting on it
# server-side keeps running workflows out of every list and watch.
COMPLETED_LABEL: Final = "workflows.argoproj.io/completed"
COMPLETED_SELECTOR: Final = f"{COMPLETED_LABEL}=true"
TERMINAL_PHASES: Final = frozenset({"Succeeded", "Failed", "Error"})
_TTL_FIELDS: Final = ("secondsAfterCompletion", "secondsAfterSuccess", "secondsAfterFailure")


def adapt_workflow(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """An Argo Workflow object -> RunFinished (terminal phase), RunDeleted, or Ignored."""
    workflow = as_object(obj, "Workflow")
    api_version = check_type(workflow, GROUP, KIND, DEFAULT_API_VERSION)
    meta = read_metadata(workflow, KIND)
    where = f"Workflow {meta.subject}"
    status = child_object(workflow, "status", f"{where}: status")
    spec = child_object(workflow, "spec", f"{where}: spec")
    phase = optional_str(status, "phase", f"{where}: status.phase") or ""
    run = run_ref(
        engine=Engine.ARGO,
        api_version=api_version,
        kind=KIND,
        meta=meta,
        phase=phase,
        finished_at=timestamp(status, "finishedAt", f"{where}: status.finishedAt"),
        ttl_strategy=_ttl_strategy(spec.get("ttlStrategy"), where),
    )
    if deleted:
        return RunDeleted(run=run)
    if phase not in TERMINAL_PHASES:
        return Ignored(f"{where} is {phase or 'not started'}, not finished")
    return RunFinished(run=run)


def _ttl_strategy(value: Any, where: str) -> ArgoTTLStrategy | None:
    if value is None:
        return None
    strategy = as_object(value, f"{where}: spec.ttlStrategy")
    seconds: dict[str, int] = {}
    for name in _TTL_FIELDS:
        item = strategy.get(name)
        if item is None:
            continue
        # bool is an int in Python, and pydantic would also accept "30"; the API server
        # stores int32, so anything else is not a Workflow it produced.
        if not isinstance(item, int) or isinstance(item, bool):
            raise InvalidEvent(
                f"{where}: spec.ttlStrategy.{name} must be an integer, not {json_kind(item)}"
            )
        seconds[name] = item
    try:
        return ArgoTTLStrategy.model_validate(seconds)
    except ValidationError as exc:
        raise InvalidEvent(f"{where}: spec.ttlStrategy: {describe_validation_error(exc)}") from None
