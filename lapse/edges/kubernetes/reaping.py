"""The object reaper's port onto the API server (functions/object_reaper/ports.py): the
reads and the guarded DELETE of `KubeObjects`, with the client library's errors mapped at
this edge into the one failure hierarchy (functions/reaping/failures.py), as httpx maps
httpcore's. The reaper never catches a library's exception."""

from __future__ import annotations

from typing import Any, NoReturn

import urllib3
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import ApiCallFailure, api_failure
from lapse.edges.kubernetes.objects import KubeObjects
from lapse.events.kinds import KindSpec
from lapse.functions.reaping.failures import Gone, TargetFailure, of_http

# What the client raises for a failed call: the server's answer, or none (urllib3's own
# failures, and the OSError that escapes it: refused sockets, TLS).
CLIENT_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


class ReapedObjects:
    """`ObjectAccess` over `KubeObjects`."""

    def __init__(self, objects: KubeObjects) -> None:
        self.objects = objects

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        try:
            return await self.objects.get(kind, namespace, name, request_timeout=request_timeout)
        except CLIENT_ERRORS as exc:
            _raise("get", kind, namespace, name, exc)

    async def list_items(
        self,
        kind: KindSpec,
        namespace: str,
        *,
        label_selector: str,
        request_timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        try:
            return await self.objects.list_items(
                kind, namespace, label_selector=label_selector, request_timeout=request_timeout
            )
        except CLIENT_ERRORS as exc:
            _raise("list", kind, namespace, label_selector, exc)

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
        try:
            await self.objects.delete(
                kind,
                namespace,
                name,
                uid=uid,
                resource_version=resource_version,
                propagation_policy=propagation_policy,
                request_timeout=request_timeout,
            )
        except CLIENT_ERRORS as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                raise Gone(f"{kind.kind} {namespace}/{name} was deleted by someone else") from exc
            _raise("delete", kind, namespace, name, exc)


def _raise(verb: str, kind: KindSpec, namespace: str, name: str, exc: BaseException) -> NoReturn:
    failure = api_failure(exc)
    assert failure is not None  # every CLIENT_ERRORS is one
    raise failure_of(failure, verb, kind, namespace, name) from exc


def failure_of(
    failure: ApiCallFailure, verb: str, kind: KindSpec, namespace: str, name: str
) -> TargetFailure:
    """What a failed call to `verb` an object means (functions/reaping/failures.py)."""
    return of_http(
        failure.status,
        failure.message,
        what=f"{verb} {kind.kind} {namespace}/{name}",
        retry_after=failure.retry_after,
        forbidden=(
            f"lapse needs the '{verb}' verb on {kind.resource}.{kind.group} in namespace "
            f"{namespace!r} (check its RBAC)"
        ),
        server="the API server",
    )
