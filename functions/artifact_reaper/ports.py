"""What the artifact reaper (and the planner, capturing) needs from outside, as Protocols.
The edges are `lapse/edges/artifacts/`: object stores through obstore, captures in NATS."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture
from lapse.functions.artifact_reaper.ownership import LiveArtifact, Protection
from lapse.functions.errors import FunctionError


@dataclass(frozen=True, slots=True)
class StoredObject:
    path: str
    size: int


class StoreUnavailable(FunctionError):
    """The store did not answer, or asked to come back (timeouts, 5xx, 429, throttling):
    an outage, waited out like the API server's."""


class StoreRefused(FunctionError):
    """The store refused for a reason retrying will not change (403, no such bucket)."""


class ObjectStores(Protocol):
    """The configured stores, by name. Raise `StoreUnavailable` or `StoreRefused`."""

    async def list(self, store: str, prefix: str) -> list[StoredObject]:
        """Every object under `prefix` (whole '/'-separated parts: `a/b` lists `a/b/x`,
        never `a/bc`)."""
        ...

    async def head(self, store: str, key: str) -> StoredObject | None:
        """The object `key` itself, or None."""
        ...

    async def delete(self, store: str, objects: Sequence[StoredObject]) -> None:
        """Delete these objects (batched; an object already gone is no error)."""
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


class LiveRunsRefused(FunctionError):
    """The API server refused to list the live runs (403): nothing is deleted without
    them, and that is said loudly."""


class LiveRuns(Protocol):
    """What the runs that exist now in the API server record (Running ones too), read at
    the moment of deleting. Raise `RetryLater` when the API server does not answer,
    `LiveRunsRefused` when it refuses."""

    async def recorded(self) -> list[LiveArtifact]: ...


class RepositoryReader(Protocol):
    """An Argo artifact repository's bucket per provider, read from its ConfigMap."""

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]: ...
