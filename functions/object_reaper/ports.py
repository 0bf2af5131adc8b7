"""What the object reaper needs from the Kubernetes API, as Protocols.

`lapse.edges.kubernetes.reaping.ReapedObjects` and `lapse.edges.kubernetes.KubeEvents`
satisfy them. Every call names the kind (`KindSpec`: group, version, resource), so one
reaper serves every configured kind. The edge maps the client library's errors into the
one failure hierarchy (functions/reaping/failures.py): a call raises `Unavailable` (no
answer, 408, 429, 5xx), `Refused` (401, 403, anything the server will refuse again), and a
DELETE `Gone` (404) or `Conflict` (409: a precondition failed); the reaper never sees the
library's exceptions.
"""

from __future__ import annotations

from typing import Any, Protocol

from lapse.events.kinds import KindSpec
from lapse.functions.ports import ObjectLister


class ObjectAccess(ObjectLister, Protocol):
    """`list_items` (ObjectLister): a gate's children, a keep_last group."""

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        """The current object, or None when it does not exist."""
        ...

    async def delete(
        self,
        kind: KindSpec,
        namespace: str,
        name: str,
        *,
        uid: str,
        resource_version: str | None = None,
        propagation_policy: str = "Background",
        request_timeout: float | None = None,
    ) -> None:
        """DELETE with uid (and resourceVersion) preconditions."""
        ...


class EventRecorder(Protocol):
    """Writes a Kubernetes Event about an object (`kubectl describe` / `get events`).
    Best effort: it logs a failure and never raises."""

    async def record(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        api_version: str,
        kind: str,
        reason: str,
        message: str,
        event_type: str = "Normal",
    ) -> None: ...
