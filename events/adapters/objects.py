"""Any configured kind of run object -> RunFinished / RunDeleted / Ignored, read by its
`KindSpec` (events/kinds.py): the one adapter for Kubernetes objects.

What differs between kinds is data (the phase field or the conditions, where the finish
time is, a server-side selector); the engine's own TTL field is the one piece of code per
engine (`_engine_ttl`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ValidationError

from lapse.events.adapters.argo_artifacts import argo_artifacts
from lapse.events.adapters.kube import (
    as_object,
    check_type,
    child_list,
    child_object,
    json_kind,
    optional_str,
    read_metadata,
    run_ref,
    timestamp,
)
from lapse.events.adapters.result import Ignored
from lapse.events.errors import InvalidEvent, describe_validation_error
from lapse.events.kinds import CONDITION, ByPhase, EngineTTL, KindSpec
from lapse.events.models import RunDeleted, RunFinished
from lapse.events.run import ArgoTTLStrategy, Engine, RunRef

RUNNING = "Running"
_ARGO_TTL_FIELDS = ("secondsAfterCompletion", "secondsAfterSuccess", "secondsAfterFailure")


def adapt(obj: object, spec: KindSpec, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """An object of `spec`'s kind -> RunFinished (finished), RunDeleted, or Ignored."""
    run, controller = read_run(obj, spec)
    if deleted:
        return RunDeleted(run=run)
    if run.phase == RUNNING:
        return Ignored(f"{spec.kind} {run.subject} {_unfinished(obj, spec)}")
    if spec.skip_controlled and controller is not None:
        return Ignored(
            f"{spec.kind} {run.subject} is controlled by {controller}: it is left to its owner"
        )
    artifacts = argo_artifacts(as_object(obj, spec.kind)) if spec.engine is Engine.ARGO else None
    return RunFinished(run=run, artifacts=artifacts)


def read_run(obj: object, spec: KindSpec) -> tuple[RunRef, str | None]:
    """The normalized run (phase `Running` while not finished) and the controlling owner
    (`Kind/name`), if any."""
    body = as_object(obj, spec.kind)
    # The object may come in another served version (Tekton's events carry v1beta1); the
    # run is named by the configured one, which the reaper reads and deletes by.
    check_type(body, spec.group, spec.kind, spec.api_version)
    meta = read_metadata(body, spec.kind)
    where = f"{spec.kind} {meta.subject}"
    if isinstance(spec.finished, ByPhase):
        phase, finished_at = _by_phase(body, spec.finished, where)
    else:
        phase, finished_at = _by_conditions(body, spec, where)
    run = run_ref(
        engine=spec.engine,
        api_version=spec.api_version,
        kind=spec.kind,
        meta=meta,
        phase=phase,
        finished_at=finished_at,
        ttl_strategy=_engine_ttl(body, spec.engine_ttl, where),
    )
    return run, _controller(body, where)


def _unfinished(obj: object, spec: KindSpec) -> str:
    """How an unfinished object says so: its phase, when the kind has one."""
    if isinstance(spec.finished, ByPhase) and isinstance(obj, dict):
        node: Any = obj
        for key in spec.finished.field.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return f"is {node if isinstance(node, str) and node else 'not started'}, not finished"
    return "has not finished"


def _by_phase(body: dict[str, Any], rule: ByPhase, where: str) -> tuple[str, datetime | None]:
    parent = _parent(body, rule.field, where)
    leaf = rule.field.rpartition(".")[2]
    phase = optional_str(parent, leaf, f"{where}: {rule.field}") or ""
    if phase not in rule.phases:
        return RUNNING, None
    for path in rule.at:
        found = timestamp(_parent(body, path, where), path.rpartition(".")[2], f"{where}: {path}")
        if found is not None:
            return rule.reported(phase), found
    return rule.reported(phase), None


def _by_conditions(body: dict[str, Any], spec: KindSpec, where: str) -> tuple[str, datetime | None]:
    assert not isinstance(spec.finished, ByPhase)
    status = child_object(body, "status", f"{where}: status")
    present: list[dict[str, Any]] = []
    types = {rule.type for rule in spec.finished.conditions}
    for index, item in enumerate(child_list(status, "conditions", f"{where}: status.conditions")):
        entry = as_object(item, f"{where}: status.conditions[{index}]")
        # A condition of another type may hold anything; only the ones that decide are read.
        condition_type = entry.get("type")
        if isinstance(condition_type, str) and condition_type in types:
            optional_str(entry, "status", f"{where}: {condition_type} condition status")
        present.append(entry)
    for rule in spec.finished.conditions:
        for index, entry in enumerate(present):
            if entry.get("type") != rule.type or entry.get("status") != rule.status:
                continue
            for source in spec.finished.at:
                if source == CONDITION:
                    found = timestamp(
                        entry, "lastTransitionTime", f"{where}: status.conditions[{index}]"
                    )
                else:
                    leaf = source.rpartition(".")[2]
                    found = timestamp(_parent(body, source, where), leaf, f"{where}: {source}")
                if found is not None:
                    return rule.phase, found
            return rule.phase, None
    return RUNNING, None


def _parent(body: dict[str, Any], path: str, where: str) -> dict[str, Any]:
    """The object holding the last key of `path` (empty when a step is absent)."""
    node = body
    walked = []
    for key in path.split(".")[:-1]:
        walked.append(key)
        node = child_object(node, key, f"{where}: {'.'.join(walked)}")
    return node


def _controller(body: dict[str, Any], where: str) -> str | None:
    meta = child_object(body, "metadata", f"{where}: metadata")
    owners = child_list(meta, "ownerReferences", f"{where}: metadata.ownerReferences")
    for index, item in enumerate(owners):
        owner = as_object(item, f"{where}: metadata.ownerReferences[{index}]")
        if owner.get("controller") is True:
            return f"{owner.get('kind')}/{owner.get('name')}"
    return None


def _engine_ttl(body: dict[str, Any], engine_ttl: EngineTTL, where: str) -> ArgoTTLStrategy | None:
    if engine_ttl is EngineTTL.ARGO:
        # Argo's GetTTLStrategy: the Workflow's own spec.ttlStrategy wins as a whole, else
        # the one of the WorkflowTemplate it was submitted from (argo-workflows#3227).
        spec = child_object(body, "spec", f"{where}: spec")
        if spec.get("ttlStrategy") is not None:
            return _argo_ttl(spec["ttlStrategy"], f"{where}: spec.ttlStrategy")
        status = child_object(body, "status", f"{where}: status")
        stored = child_object(
            status, "storedWorkflowTemplateSpec", f"{where}: status.storedWorkflowTemplateSpec"
        )
        if stored.get("ttlStrategy") is not None:
            return _argo_ttl(
                stored["ttlStrategy"], f"{where}: status.storedWorkflowTemplateSpec.ttlStrategy"
            )
        return None
    if engine_ttl is EngineTTL.JOB:
        return _seconds_field(body, "ttlSecondsAfterFinished", where)
    if engine_ttl is EngineTTL.RAY:
        return _ray_ttl(body, where)
    if engine_ttl is EngineTTL.SPARK:
        return _seconds_field(body, "timeToLiveSeconds", where)
    return None


def _seconds_field(body: dict[str, Any], name: str, where: str) -> ArgoTTLStrategy | None:
    """spec.<name>, seconds after finishing in any phase (absent: no engine TTL)."""
    spec = child_object(body, "spec", f"{where}: spec")
    seconds = spec.get(name)
    if seconds is None:
        return None
    return _strategy(
        {"secondsAfterCompletion": _int(seconds, f"{where}: spec.{name}")},
        f"{where}: spec.{name}",
    )


def _ray_ttl(body: dict[str, Any], where: str) -> ArgoTTLStrategy | None:
    """KubeRay's rule (rayjob_controller.go, handleShutdownAfterJobFinishes): the TTL
    counts only with shutdownAfterJobFinishes true, and not for a RayJob that runs on an
    existing cluster (clusterSelector), whose finish KubeRay leaves alone. Absent, it is
    the CRD's default, 0: KubeRay acts the moment the RayJob finished, and so does lapse
    (with Background propagation the RayCluster goes with the RayJob, as KubeRay's own
    DELETE_RAYJOB_CR_AFTER_JOB_FINISHES does)."""
    spec = child_object(body, "spec", f"{where}: spec")
    shutdown = spec.get("shutdownAfterJobFinishes")
    if shutdown is not None and not isinstance(shutdown, bool):
        raise InvalidEvent(
            f"{where}: spec.shutdownAfterJobFinishes must be a boolean, not {json_kind(shutdown)}"
        )
    if not shutdown or child_object(spec, "clusterSelector", f"{where}: spec.clusterSelector"):
        return None
    seconds = spec.get("ttlSecondsAfterFinished")
    if seconds is None:
        seconds = 0
    return _strategy(
        {"secondsAfterCompletion": _int(seconds, f"{where}: spec.ttlSecondsAfterFinished")},
        f"{where}: spec.ttlSecondsAfterFinished",
    )


def _argo_ttl(value: Any, where: str) -> ArgoTTLStrategy:
    strategy = as_object(value, where)
    seconds = {
        name: _int(strategy[name], f"{where}.{name}")
        for name in _ARGO_TTL_FIELDS
        if strategy.get(name) is not None
    }
    return _strategy(seconds, where)


def _int(value: Any, where: str) -> int:
    # bool is an int in Python, and pydantic would also accept "30"; the API server stores
    # int32, so anything else is not an object it produced.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidEvent(f"{where} must be an integer, not {json_kind(value)}")
    return value


def _strategy(seconds: dict[str, int], where: str) -> ArgoTTLStrategy:
    try:
        return ArgoTTLStrategy.model_validate(seconds)
    except ValidationError as exc:
        raise InvalidEvent(f"{where}: {describe_validation_error(exc)}") from None
