"""Which keys of a store a run may delete, proved from what its tenant cannot write (pure).

A tenant may create and patch the runs of its namespace, status included (Argo's Workflow
has no status subresource), so every key a run *records* and every label it carries is the
tenant's word. What the tenant cannot write is the run's identity as the API server keeps
it (namespace, name, uid, kind) and lapse's own configuration. So:

- a store serves the runs of its `namespaces` and `kinds` only (`ArtifactStore.serves`);
- a key is the run's when it lies inside one of the store's `roots` rendered from that
  identity (`{namespace}/` by default), strictly below a root that names no single run
  (the whole of `team-a/` is no one run's), or is a declared capture rendered from that
  identity alone (`logs/{namespace}/{name}/{uid}/`);
- whatever another run records is kept, and nothing under it is deleted
  (`protections`, `guarded`): the other runs' captures lapse stored, and what the live
  runs in the API server record now (Running ones included).

A label or annotation never widens this: a template naming one renders a key that must
still lie inside a root.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lapse.events.artifacts import StoredArtifact
from lapse.events.run import RunRef
from lapse.functions.artifact_reaper.capture import CapturedItem, render
from lapse.functions.artifact_reaper.stores import (
    ONE_RUN,
    ArtifactsConfig,
    ArtifactStore,
    fields,
    is_identity,
)


@dataclass(frozen=True, slots=True)
class RunRoot:
    """A root rendered for one run: `prefix` (ends in '/', or the store's url root) and
    whether it names one run (the run may then delete the root itself)."""

    prefix: str
    one_run: bool


def roots(store: ArtifactStore, run: RunRef) -> tuple[RunRoot, ...]:
    """The store's roots for this run; a root whose value is missing is none."""
    found: list[RunRoot] = []
    for template in store.roots:
        rendered = render(template, run) if template else ""
        if rendered is not None:
            found.append(RunRoot(store.root + rendered, bool(fields(template) & ONE_RUN)))
    return tuple(found)


def declared(store: ArtifactStore, run: RunRef, kind: str | None) -> tuple[str, ...]:
    """The store's declared captures for the run's kind that are rendered from its identity
    alone: each is the run's own, wherever it lies below the store's url root."""
    found: list[str] = []
    for template in store.capture.get(kind or "", ()):
        if is_identity(template) and (key := render(template, run)) is not None:
            found.append(store.root + key)
    return tuple(found)


def inside(key: str, root: RunRoot) -> bool:
    """`key` lies inside the root: below it, or the root itself when it names one run."""
    if not key.startswith(root.prefix):
        return False
    return len(key) > len(root.prefix) or root.one_run


def unowned(item: CapturedItem, store: ArtifactStore, run: RunRef, kind: str | None) -> str | None:
    """None when `item` is the run's to delete; otherwise why it is kept."""
    if (why := store.serves(run.namespace, kind)) is not None:
        return f"{item.key!r} kept: {why}"
    if item.tree and item.key in declared(store, run, kind):
        return None
    rendered = roots(store, run)
    if any(inside(item.key, root) for root in rendered):
        return None
    if any(item.key == root.prefix for root in rendered):
        return (
            f"{item.key!r} kept: the whole of the root {item.key!r} in store {store.name!r} "
            "is no one run's (only what lies below it)"
        )
    where = ", ".join(repr(root.prefix) for root in rendered) or "none renders"
    return (
        f"{item.key!r} kept: outside the run's roots in store {store.name!r} ({where}); "
        "what a run records is deleted only there"
    )


@dataclass(frozen=True, slots=True)
class Protection:
    """A key another run records: it, and everything under it, is kept."""

    item: CapturedItem
    by: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LiveArtifact:
    """A key a run that still exists in the API server records (Running or not)."""

    run: str  # namespace/name, for the outcome
    uid: str
    artifact: StoredArtifact


def live_protections(
    config: ArtifactsConfig, live: Iterable[LiveArtifact], uid: str
) -> list[Protection]:
    """The live runs' keys, in every store that may hold them (a key that names no bucket
    may be in any store of its provider: protected in each). The run itself is none."""
    found: dict[CapturedItem, list[str]] = {}
    for entry in live:
        if entry.uid == uid:
            continue
        artifact = entry.artifact
        key = artifact.key.rstrip("/") or artifact.key
        for store in config.stores:
            if store.provider != artifact.provider:
                continue
            if artifact.bucket is not None and artifact.bucket != store.bucket:
                continue
            item = CapturedItem(store=store.name, key=key, tree=False)
            by = found.setdefault(item, [])
            if entry.run not in by:
                by.append(entry.run)
    return [Protection(item, tuple(by)) for item, by in found.items()]


def covers(protection: Protection, store: str, path: str) -> bool:
    """The protected key is `path`, or `path` lies under it."""
    key = protection.item.key.rstrip("/")
    return protection.item.store == store and (path == key or path.startswith(key + "/"))


def guarded(store: str, path: str, protections: Sequence[Protection]) -> Protection | None:
    """The protection that keeps `path`, if any."""
    return next((p for p in protections if covers(p, store, path)), None)
