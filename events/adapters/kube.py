"""Reading Kubernetes object dicts (as the API server returns them) defensively.

Adapters see whatever arrives: every accessor checks the JSON type it expects and raises
`InvalidEvent` naming the field, so no `KeyError`/`TypeError` escapes on odd input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from lapse.events.errors import InvalidEvent, describe_validation_error
from lapse.events.run import KFP_RUN_ID_LABEL, ArgoTTLStrategy, Engine, RunRef
from lapse.events.timeutil import parse_rfc3339


def as_object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidEvent(f"{where} must be a JSON object, not {json_kind(value)}")
    return value


def child_object(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """parent[key] as an object; absent or null reads as empty (Kubernetes omits empties)."""
    value = parent.get(key)
    return {} if value is None else as_object(value, where)


def child_list(parent: dict[str, Any], key: str, where: str) -> list[Any]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidEvent(f"{where} must be a list, not {json_kind(value)}")
    return value


def optional_str(parent: dict[str, Any], key: str, where: str) -> str | None:
    value = parent.get(key)
    if value is None or isinstance(value, str):
        return value
    raise InvalidEvent(f"{where} must be a string, not {json_kind(value)}")


def required_str(parent: dict[str, Any], key: str, where: str) -> str:
    value = optional_str(parent, key, where)
    if not value:
        raise InvalidEvent(f"{where} is missing")
    return value


def string_map(parent: dict[str, Any], key: str, where: str) -> dict[str, str]:
    value = child_object(parent, key, where)
    if not all(isinstance(v, str) for v in value.values()):
        raise InvalidEvent(f"{where} values must all be strings")
    return value


def timestamp(parent: dict[str, Any], key: str, where: str) -> datetime | None:
    value = optional_str(parent, key, where)
    if not value:
        return None
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise InvalidEvent(f"{where}: {exc}") from None


def api_group(api_version: str) -> str:
    """`argoproj.io/v1alpha1` -> `argoproj.io`; the core group (`v1`) is ''."""
    return api_version.rpartition("/")[0]


def json_kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )


def check_type(obj: dict[str, Any], group: str, kind: str, default_api_version: str) -> str:
    """The object's apiVersion, after checking it is (group, kind).

    Typed list items and informer caches carry no apiVersion/kind, so absence means "the
    caller already knows"; a present but different value is a routing mistake.
    """
    api_version = optional_str(obj, "apiVersion", "apiVersion") or default_api_version
    actual_kind = optional_str(obj, "kind", "kind") or kind
    if api_group(api_version) != group or actual_kind != kind:
        raise InvalidEvent(f"expected {group} {kind}, got {api_version} {actual_kind}")
    return api_version


@dataclass(frozen=True, slots=True)
class Metadata:
    namespace: str
    name: str
    uid: str
    resource_version: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def subject(self) -> str:
        return f"{self.namespace}/{self.name}"


def read_metadata(obj: dict[str, Any], kind: str) -> Metadata:
    meta = child_object(obj, "metadata", f"{kind} metadata")
    name = required_str(meta, "name", f"{kind} metadata.name")
    where = f"{kind} {name}"
    namespace = required_str(meta, "namespace", f"{where}: metadata.namespace")
    where = f"{kind} {namespace}/{name}"
    return Metadata(
        namespace=namespace,
        name=name,
        uid=required_str(meta, "uid", f"{where}: metadata.uid"),
        resource_version=optional_str(meta, "resourceVersion", f"{where}: resourceVersion"),
        labels=string_map(meta, "labels", f"{where}: metadata.labels"),
        annotations=string_map(meta, "annotations", f"{where}: metadata.annotations"),
    )


def condition(status: dict[str, Any], condition_type: str, where: str) -> dict[str, Any] | None:
    """The status condition of one type (Kubernetes list-of-conditions convention)."""
    for index, item in enumerate(child_list(status, "conditions", f"{where}: status.conditions")):
        entry = as_object(item, f"{where}: status.conditions[{index}]")
        if entry.get("type") == condition_type:
            return entry
    return None


def run_ref(
    *,
    engine: Engine,
    api_version: str,
    kind: str,
    meta: Metadata,
    phase: str,
    finished_at: datetime | None,
    ttl_strategy: ArgoTTLStrategy | None = None,
) -> RunRef:
    try:
        return RunRef(
            engine=engine,
            api_version=api_version,
            kind=kind,
            namespace=meta.namespace,
            name=meta.name,
            uid=meta.uid,
            resource_version=meta.resource_version,
            phase=phase,
            finished_at=finished_at,
            labels=meta.labels,
            annotations=meta.annotations,
            ttl_strategy=ttl_strategy,
            kfp_run_id=meta.labels.get(KFP_RUN_ID_LABEL) or None,
        )
    except ValidationError as exc:
        where = f"{kind} {meta.subject}"
        raise InvalidEvent(f"{where}: {describe_validation_error(exc)}") from None
