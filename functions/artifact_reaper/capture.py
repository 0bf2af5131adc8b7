"""What belongs to a run in object storage, captured when the run is planned (pure).

The run object is gone by the time its artifacts fall due, so the planner captures them
from the finished run and keeps the list beside the schedule, keyed by the run's uid
(lapse/edges/artifacts/captures.py):

- what the run object recorded (`lapse.events.artifacts.RunArtifacts`: Argo's output artifacts,
  the archived `main-logs` among them), when a configured store holds it: same provider
  and bucket, under the store's prefix root (an artifact naming another endpoint is not
  that store's);
- each store's declared prefixes for the run's kind (`capture: {job: ["logs/{namespace}/
  {name}/{uid}/"]}`), rendered from the run. A template whose value is missing, empty or
  holds a '/' is not rendered (it would name a shallower or another tree): said in
  `unrendered`.
- KFP v2's artifacts under the pipeline root (`{pipeline_name}/{run_id}/`) are a declared
  prefix of the store that holds the pipeline root; the URIs ML Metadata records for a
  run are another source that would add items here (`RunCapture.items`).

Nothing is judged deletable here: the reaper judges every item again, at the deadline,
against the configuration it runs with (verdict.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from lapse.events.artifacts import Provider, RunArtifacts, StoredArtifact
from lapse.events.run import RunRef
from lapse.functions.artifact_reaper.stores import PLACEHOLDER, ArtifactsConfig, ArtifactStore

MAX_UNRENDERED = 32


class CapturedItem(BaseModel):
    """One thing to delete in one store. `tree`: every object under `key` (a prefix ending
    in '/'); otherwise the object `key` and every object under `key/` (an Argo artifact is
    a file or, unarchived, a directory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str
    key: str = Field(min_length=1)
    tree: bool


class RunCapture(BaseModel):
    """Everything captured for one run, as kept beside its artifacts schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uid: str
    items: tuple[CapturedItem, ...] = ()
    # Recorded artifacts in no configured store (URLs): never touched, said in the outcome.
    outside: tuple[str, ...] = ()
    unrendered: tuple[str, ...] = ()
    collected_by_engine: str | None = None


def capture(
    run: RunRef,
    kind_name: str,
    recorded: RunArtifacts | None,
    config: ArtifactsConfig,
    repository: Mapping[Provider, str] | None = None,
) -> RunCapture:
    """The run's capture. `repository`: the bucket of the run's artifact repository per
    provider (read from its ConfigMap), for recorded artifacts that name none."""
    items: list[CapturedItem] = []
    outside: list[str] = []
    unrendered: list[str] = []
    for artifact in recorded.artifacts if recorded else ():
        bucket = artifact.bucket or (repository or {}).get(artifact.provider)
        store = _holder(artifact, bucket, config)
        if store is None or bucket is None:
            outside.append(f"{artifact.provider}://{bucket or '?'}/{artifact.key}")
            continue
        _add(items, CapturedItem(store=store.name, key=artifact.key, tree=False))
    for store in config.stores:
        for template in store.capture.get(kind_name, ()):
            key = render(template, run)
            if key is None:
                unrendered.append(f"{store.name}: {template}")
                continue
            _add(items, CapturedItem(store=store.name, key=store.root + key, tree=True))
    return RunCapture(
        uid=run.uid,
        items=tuple(items),
        outside=tuple(outside),
        unrendered=tuple(unrendered[:MAX_UNRENDERED]),
        collected_by_engine=recorded.collected_by_engine if recorded else None,
    )


def render(template: str, run: RunRef) -> str | None:
    """The template with the run's values, or None when one is missing, empty or holds a
    '/' (it would make the prefix shallower, or another tree)."""
    values: dict[str, str | None] = {
        "namespace": run.namespace,
        "name": run.name,
        "uid": run.uid,
        "kind": run.kind.lower(),
        "run_id": run.kfp_run_id,
    }
    missing = False

    def value(match: re.Match[str]) -> str:
        nonlocal missing
        field = match.group(1)
        source, _, key = field.partition(":")
        if source == "label":
            found = run.labels.get(key)
        elif source == "annotation":
            found = run.annotations.get(key)
        else:
            found = values.get(field)
        if not found or "/" in found or found in (".", ".."):
            missing = True
            return ""
        return found

    rendered = PLACEHOLDER.sub(value, template)
    return None if missing else rendered


def _holder(
    artifact: StoredArtifact, bucket: str | None, config: ArtifactsConfig
) -> ArtifactStore | None:
    for store in config.stores:
        if not store.engine_outputs or store.provider != artifact.provider:
            continue
        if store.bucket != bucket or not artifact.key.startswith(store.root):
            continue
        if (
            artifact.endpoint
            and store.endpoint
            and _host(artifact.endpoint) != _host(store.endpoint)
        ):
            continue
        return store
    return None


def _host(endpoint: str) -> str:
    """`http://minio:9000/` and Argo's `minio:9000` name the same server."""
    return endpoint.partition("://")[2].rstrip("/") if "://" in endpoint else endpoint.rstrip("/")


def _add(items: list[CapturedItem], item: CapturedItem) -> None:
    if item not in items:
        items.append(item)
