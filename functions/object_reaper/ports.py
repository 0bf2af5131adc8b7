"""What the object reaper needs from the Kubernetes API, as Protocols.

`lapse.edges.kubernetes.KubeObjects` and `KubeEvents` satisfy them. Every call names the
kind (`KindSpec`: group, version, resource), so one reaper serves every configured kind.
The handler never sees the client library's exceptions: the edge translates them
(`failure`) into a status and a message, so deciding what a failure means stays pure.
"""

from __future__ import annotations

from typing import Any, Protocol

from lapse.events.kinds import KindSpec
from lapse.functions.ports import ObjectLister


class CallFailure(Protocol):
    """A failed API call. `status` is the HTTP status, None when no response came back
    (connection refused, timeout, TLS failure)."""

    @property
    def status(self) -> int | None: ...

    @property
    def message(self) -> str: ...

    @property
    def retry_after(self) -> float | None: ...


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

    def failure(self, exc: BaseException) -> CallFailure | None:
        """What `exc` says about the call, or None if it is not an API/transport failure
        (then it is a bug and propagates)."""
        ...


class EventRecorder(Protocol):
    """Writes a Kubernetes Event about an object (`kubectl describe` / `get events`)."""

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
