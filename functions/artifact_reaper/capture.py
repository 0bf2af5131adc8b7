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
  prefix of the store that holds the pipeline root;
- the URIs ML Metadata records for a KFP run (`with_metadata`): the row-reaper adds them to
  the capture in the transaction that deletes the run's MLMD rows (after it, nothing says
  which URIs were the run's): those the run alone used are items, those another run still
  uses (KFP caching) are `kept`, never deleted, even inside the run's declared prefix.

Nothing is judged deletable here: the reaper judges every item again, at the deadline,
against the configuration it runs with (verdict.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class KeptItem(BaseModel):
    """An item another run still uses (ML Metadata says so): never deleted, nor anything
    under it, whatever other item of the run covers it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item: CapturedItem
    by: tuple[str, ...]


class MetadataAccount(BaseModel):
    """ML Metadata's account of the run's artifacts, recorded by the row-reaper just before
    it deleted the run's MLMD rows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    items: tuple[CapturedItem, ...] = ()
    kept: tuple[KeptItem, ...] = ()
    outside: tuple[str, ...] = ()


class RunCapture(BaseModel):
    """Everything captured for one run, as kept beside its artifacts schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uid: str
    # The run's kind name (events/kinds.py) when captured: a store serves some kinds only.
    # None: captured before lapse recorded it; a store that names its kinds keeps those.
    kind: str | None = None
    items: tuple[CapturedItem, ...] = ()
    # Recorded artifacts in no configured store (URLs): never touched, said in the outcome.
    outside: tuple[str, ...] = ()
    unrendered: tuple[str, ...] = ()
    collected_by_engine: str | None = None
    # None: ML Metadata's account is not recorded (not a KFP run, or its rows not deleted).
    metadata: MetadataAccount | None = None

    @property
    def all_items(self) -> tuple[CapturedItem, ...]:
        """The planner's items, then ML Metadata's, each once."""
        items = list(self.items)
        for item in self.metadata.items if self.metadata else ():
            _add(items, item)
        return tuple(items)

    @property
    def kept(self) -> tuple[KeptItem, ...]:
        return self.metadata.kept if self.metadata else ()


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
        store = _holder(artifact, bucket, config, run, kind_name)
        if store is None or bucket is None:
            outside.append(f"{artifact.provider}://{bucket or '?'}/{artifact.key}")
            continue
        _add(items, CapturedItem(store=store.name, key=artifact.key, tree=False))
    for store in config.stores:
        if store.serves(run.namespace, kind_name) is not None:
            continue
        for template in store.capture.get(kind_name, ()):
            key = render(template, run)
            if key is None:
                unrendered.append(f"{store.name}: {template}")
                continue
            _add(items, CapturedItem(store=store.name, key=store.root + key, tree=True))
    return RunCapture(
        uid=run.uid,
        kind=kind_name,
        items=tuple(items),
        outside=tuple(outside),
        unrendered=tuple(unrendered[:MAX_UNRENDERED]),
        collected_by_engine=recorded.collected_by_engine if recorded else None,
    )


# ML Metadata's URI schemes (KFP writes `minio://` for its in-cluster MinIO, an S3 server).
URI_SCHEMES: Final[dict[str, Provider]] = {"s3": "s3", "minio": "s3", "gs": "gcs", "az": "azure"}


def with_metadata(
    captured: RunCapture,
    run_only: Sequence[str],
    shared: Sequence[tuple[str, Sequence[str]]],
    config: ArtifactsConfig,
) -> RunCapture:
    """The capture with ML Metadata's account: each run-only URI a configured store holds
    becomes an item (a file, or a directory's prefix: `tree` False covers both), others
    are named as outside the stores; each shared URI a store holds is kept."""
    items: list[CapturedItem] = []
    outside: list[str] = []
    for uri in run_only:
        item = _item_of(uri, config)
        if item is None:
            outside.append(uri)
        else:
            _add(items, item)
    kept = [
        KeptItem(item=item, by=tuple(by))
        for uri, by in shared
        if (item := _item_of(uri, config)) is not None
    ]
    account = MetadataAccount(items=tuple(items), kept=tuple(kept), outside=tuple(outside))
    return captured.model_copy(update={"metadata": account})


def carried(earlier: RunCapture | None, new: RunCapture) -> RunCapture:
    """A capture made again (the run planned again) keeps ML Metadata's account: the rows
    it came from may be gone."""
    if earlier is None or earlier.metadata is None or new.metadata is not None:
        return new
    return new.model_copy(update={"metadata": earlier.metadata})


def _item_of(uri: str, config: ArtifactsConfig) -> CapturedItem | None:
    scheme, sep, rest = uri.partition("://")
    provider = URI_SCHEMES.get(scheme)
    bucket, _, key = rest.partition("/")
    if not sep or provider is None or not bucket or not key:
        return None
    try:
        artifact = StoredArtifact(provider=provider, bucket=bucket, key=key.rstrip("/") or key)
    except ValidationError:
        return None  # not a key lapse would delete by
    store = _holder(artifact, bucket, config)
    return None if store is None else CapturedItem(store=store.name, key=artifact.key, tree=False)


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
    artifact: StoredArtifact,
    bucket: str | None,
    config: ArtifactsConfig,
    run: RunRef | None = None,
    kind: str | None = None,
) -> ArtifactStore | None:
    """The store holding a recorded artifact: of the stores serving the run (`run` None:
    ML Metadata's URIs, judged against the run at the deadline), the first whose bucket
    and root hold it."""
    for store in config.stores:
        if not store.engine_outputs or store.provider != artifact.provider:
            continue
        if run is not None and store.serves(run.namespace, kind) is not None:
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
