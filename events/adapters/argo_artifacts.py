"""An Argo Workflow's artifacts in object storage, read from the finished object (pure).

- `status.nodes[*].outputs.artifacts[*]`: each output artifact's `s3`, `gcs` or `azure`
  location, the archived `main-logs` among them (`archiveLogs`). An artifact that states
  no bucket lives in the Workflow's artifact repository.
- `status.artifactRepositoryRef`: that repository, inline (`artifactRepository`, Argo
  ≥ 3.1) or by its ConfigMap key (the planner reads the ConfigMap).
- Argo's own artifact garbage collection (`spec.artifactGC` or an artifact's own
  `artifactGC` with a strategy other than `Never`, or Argo's finalizer
  `workflows.argoproj.io/artifact-gc`): Argo deletes those artifacts itself, and lapse
  leaves them to it (and never touches the finalizer).

Whatever is not shaped as Argo writes it is left out: an artifact lapse cannot read is
one it never deletes.

`argo_references` reads more widely, for the other direction: every key a live Workflow
(Running or not) names, inputs and arguments too, is one the artifact-reaper keeps
(functions/artifact_reaper/ownership.py). There reading too much only keeps more.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import ValidationError

from lapse.events.artifacts import Provider, RepositoryRef, RunArtifacts, StoredArtifact

ARTIFACT_GC_FINALIZER: Final = "workflows.argoproj.io/artifact-gc"
# The location field of each provider, and the field naming its object and its bucket.
_LOCATIONS: Final[tuple[tuple[Provider, str, str, str], ...]] = (
    ("s3", "s3", "key", "bucket"),
    ("gcs", "gcs", "key", "bucket"),
    ("azure", "azure", "blob", "container"),
)


def argo_artifacts(body: dict[str, Any]) -> RunArtifacts | None:
    """The Workflow's artifacts, or None when it records none and collects none itself."""
    status = _dict(body.get("status"))
    repository = _dict(_dict(status.get("artifactRepositoryRef")).get("artifactRepository"))
    found: list[StoredArtifact] = []
    engine_gc = _engine_gc(body)
    for node in _dict(status.get("nodes")).values():
        for artifact in _list(_dict(_dict(node).get("outputs")).get("artifacts")):
            artifact = _dict(artifact)
            strategy = _dict(artifact.get("artifactGC")).get("strategy")
            if isinstance(strategy, str) and strategy not in ("", "Never") and engine_gc is None:
                engine_gc = f"an output artifact has Argo's artifactGC strategy {strategy}"
            stored = _location(artifact, repository)
            if stored is not None and stored not in found:
                found.append(stored)
    ref = _repository_ref(status, body)
    if not found and engine_gc is None:
        return None
    return RunArtifacts(
        artifacts=tuple(found),
        repository=ref if any(a.bucket is None for a in found) else None,
        collected_by_engine=engine_gc,
    )


def argo_references(body: dict[str, Any]) -> list[StoredArtifact]:
    """Every artifact location the Workflow names: its nodes' outputs and inputs, and its
    spec's arguments and templates' inputs (a location still holding Argo's `{{...}}`
    template is no key yet, left out)."""
    status = _dict(body.get("status"))
    spec = _dict(body.get("spec"))
    repository = _dict(_dict(status.get("artifactRepositoryRef")).get("artifactRepository"))
    lists: list[object] = []
    for node in _dict(status.get("nodes")).values():
        for side in ("outputs", "inputs"):
            lists.append(_dict(_dict(node).get(side)).get("artifacts"))
    lists.append(_dict(spec.get("arguments")).get("artifacts"))
    for template in _list(spec.get("templates")):
        lists.append(_dict(_dict(template).get("inputs")).get("artifacts"))
    found: list[StoredArtifact] = []
    for artifacts in lists:
        for artifact in _list(artifacts):
            stored = _location(_dict(artifact), repository)
            if stored is not None and "{{" not in stored.key and stored not in found:
                found.append(stored)
    return found


def _engine_gc(body: dict[str, Any]) -> str | None:
    finalizers = _list(_dict(body.get("metadata")).get("finalizers"))
    if ARTIFACT_GC_FINALIZER in finalizers:
        return f"Argo's finalizer {ARTIFACT_GC_FINALIZER} is on the Workflow"
    strategy = _dict(_dict(body.get("spec")).get("artifactGC")).get("strategy")
    if isinstance(strategy, str) and strategy not in ("", "Never"):
        return f"the Workflow's spec.artifactGC.strategy is {strategy}"
    return None


def _location(artifact: dict[str, Any], repository: dict[str, Any]) -> StoredArtifact | None:
    for provider, field, key_field, bucket_field in _LOCATIONS:
        location = artifact.get(field)
        if not isinstance(location, dict):
            continue
        key = location.get(key_field)
        if not isinstance(key, str) or not key:
            return None
        default = _dict(repository.get(field))
        bucket = location.get(bucket_field) or default.get(bucket_field)
        endpoint = location.get("endpoint") or default.get("endpoint")
        try:
            return StoredArtifact(
                provider=provider,
                bucket=bucket if isinstance(bucket, str) and bucket else None,
                key=key,
                endpoint=endpoint if isinstance(endpoint, str) and endpoint else None,
            )
        except ValidationError:
            return None
    return None


def _repository_ref(status: dict[str, Any], body: dict[str, Any]) -> RepositoryRef | None:
    ref = _dict(status.get("artifactRepositoryRef"))
    config_map = ref.get("configMap")
    namespace = ref.get("namespace") or _dict(body.get("metadata")).get("namespace")
    if not isinstance(config_map, str) or not config_map or not isinstance(namespace, str):
        return None
    key = ref.get("key")
    return RepositoryRef(
        namespace=namespace, config_map=config_map, key=key if isinstance(key, str) else None
    )


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
