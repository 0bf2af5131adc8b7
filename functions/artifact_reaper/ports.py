"""What the artifact reaper (and the planner, capturing) needs from outside, as Protocols.
The edges are `lapse/edges/artifacts/`: object stores through obstore, captures in NATS."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture
from lapse.functions.artifact_reaper.ownership import LiveArtifact, Protection


@dataclass(frozen=True, slots=True)
class StoredObject:
    """An object as a listing saw it; `etag` (None: the store gave none) and `size` are what
    the re-check before its delete compares (`verdict.changed`)."""

    path: str
    size: int
    etag: str | None = None


@dataclass(frozen=True, slots=True)
class Deletion:
    """What a delete did with the objects it was given: `kept`, those the store refused to
    delete because they changed since they were listed (S3 `If-Match`: 412); `gone`,
    those that were not there; every other one was deleted."""

    kept: tuple[StoredObject, ...] = ()
    gone: tuple[StoredObject, ...] = ()


class ObjectStores(Protocol):
    """The configured stores, by name. Raise `failures.Unavailable` (no answer, 5xx, 429,
    throttling: waited out) or `failures.Refused` (403, no such bucket)."""

    async def list(self, store: str, prefix: str) -> list[StoredObject]:
        """Every object under `prefix` (whole '/'-separated parts: `a/b` lists `a/b/x`,
        never `a/bc`)."""
        ...

    async def head(self, store: str, key: str) -> StoredObject | None:
        """The object `key` itself, or None."""
        ...

    async def current(
        self, store: str, objects: Sequence[StoredObject]
    ) -> tuple[StoredObject, ...]:
        """These objects as they are now (those still there), listed again just before
        they are deleted: the precondition where the store takes no conditional delete,
        and a second guard where it does (docs/architecture.md, "The artifact-reaper")."""
        ...

    async def delete(self, store: str, objects: Sequence[StoredObject]) -> Deletion:
        """Delete these objects: each only while it is the object listed (its etag) where
        the store takes a conditional delete, else batched. An object already gone is no
        error."""
        ...


class Captures(Protocol):
    """Each run's capture, kept beside its artifacts schedule, keyed by the run's uid, and
    which runs captured each item (for `shared`). Raise `RetryLater` when unreachable."""

    async def put(self, capture: RunCapture) -> None: ...

    async def get(self, uid: str) -> RunCapture | None: ...

    async def sharers(self, item: CapturedItem, uid: str) -> tuple[str, ...]:
        """The uids of the other runs whose capture holds `item`."""
        ...

    async def near(self, items: Sequence[CapturedItem], uid: str) -> list[Protection]:
        """The keys other runs' captures hold in each item's store that are the item's
        key, above it or under it (whole '/'-separated parts), each with the runs' uids."""
        ...

    async def forget(self, capture: RunCapture) -> None:
        """Remove the run's capture and its references (once its artifacts are done)."""
        ...


class LiveRuns(Protocol):
    """What the runs that exist now in the API server record (Running ones too), read at
    the moment of deleting. Raise `failures.Unavailable` when the API server does not
    answer, `failures.Refused` when it refuses (nothing is deleted without them)."""

    async def recorded(self) -> list[LiveArtifact]: ...


class RepositoryReader(Protocol):
    """An Argo artifact repository's bucket per provider, read from its ConfigMap."""

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]: ...
