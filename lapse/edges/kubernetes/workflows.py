"""Argo Workflows: get, guarded delete, list, watch, and the one pager of finished ones."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from events.adapters.argo import COMPLETED_SELECTOR, GROUP, RESOURCE, VERSION
from lapse.edges.kubernetes.client import (
    ApiCallFailure,
    api_failure,
    continue_after_expiry,
    request,
    server_attributes,
    timeout_kwargs,
)
from lapse.telemetry import count_kubernetes_request

_WORKFLOWS = f"/apis/{GROUP}/{VERSION}"
_NAMESPACED = _WORKFLOWS + "/namespaces/{namespace}/" + RESOURCE
_ONE = _NAMESPACED + "/{name}"


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class Workflows:
    """Argo Workflow custom resources, as plain dicts (the shape the API returns)."""

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self._api = client.CustomObjectsApi(api_client)
        self._executor = executor
        self._server = server_attributes(api_client)

    async def _call(
        self,
        method: str,
        template: str,
        namespace: str | None,
        fn: Callable[..., tuple[Any, int, Any]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        call = functools.partial(fn, *args, **kwargs)
        return await request(self._executor, self._server, method, template, namespace, call)

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", _NAMESPACED, namespace,
            self._api.create_namespaced_custom_object_with_http_info,
            GROUP, VERSION, namespace, RESOURCE, body,
        )  # fmt: skip
        return result

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "PUT", _ONE, namespace,
            self._api.replace_namespaced_custom_object_with_http_info,
            GROUP, VERSION, namespace, RESOURCE, name, body,
        )  # fmt: skip
        return result

    async def get(
        self, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        """The current object, or None when it does not exist."""
        try:
            result: dict[str, Any] = await self._call(
                "GET", _ONE, namespace,
                self._api.get_namespaced_custom_object_with_http_info,
                GROUP, VERSION, namespace, RESOURCE, name,
                **timeout_kwargs(request_timeout),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def delete(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        resource_version: str | None = None,
        propagation_policy: str = "Background",
        request_timeout: float | None = None,
    ) -> None:
        """DELETE guarded by preconditions: the API server refuses (409) unless the object
        still has this uid (and resourceVersion, when given). Raises ApiException."""
        preconditions = client.V1Preconditions(uid=uid, resource_version=resource_version)
        body = client.V1DeleteOptions(
            preconditions=preconditions, propagation_policy=propagation_policy
        )
        await self._call(
            "DELETE", _ONE, namespace,
            self._api.delete_namespaced_custom_object_with_http_info,
            GROUP, VERSION, namespace, RESOURCE, name, body=body,
            **timeout_kwargs(request_timeout),
        )  # fmt: skip

    def failure(self, exc: BaseException) -> ApiCallFailure | None:
        """See `api_failure`; a method so that handlers can take this class as their port."""
        return api_failure(exc)

    async def list(
        self,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        limit: int = 500,
        continue_token: str | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"limit": limit}
        if label_selector:
            kwargs["label_selector"] = label_selector
        if continue_token:
            kwargs["_continue"] = continue_token
        result: dict[str, Any]
        if namespace is None:
            result = await self._call(
                "GET", f"{_WORKFLOWS}/{RESOURCE}", None,
                self._api.list_cluster_custom_object_with_http_info,
                GROUP, VERSION, RESOURCE, **kwargs,
            )  # fmt: skip
        else:
            result = await self._call(
                "GET", _NAMESPACED, namespace,
                self._api.list_namespaced_custom_object_with_http_info,
                GROUP, VERSION, namespace, RESOURCE, **kwargs,
            )  # fmt: skip
        return result

    async def watch(
        self,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """Cluster-wide watch with bookmarks. A 410 Gone surfaces as ApiException(410).

        The response is read on a pool thread; leaving the iterator closes the response,
        which ends that thread at once instead of at the next event.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue(maxsize=1000)
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
        }
        if resource_version:
            kwargs["resource_version"] = resource_version
        if label_selector:
            kwargs["label_selector"] = label_selector
        responses: list[Any] = []
        closed = threading.Event()

        def put(item: WatchEvent | BaseException | None) -> None:
            if not closed.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

        # A watch is one long request: counted, but a span lasting minutes would say nothing.
        count_kubernetes_request("GET", None)

        def pump() -> None:
            try:
                response = self._api.list_cluster_custom_object(GROUP, VERSION, RESOURCE, **kwargs)
                responses.append(response)
                for line in iter_resp_lines(response):
                    item = json.loads(line)
                    if item["type"] == "ERROR":
                        status = item.get("object", {})
                        raise ApiException(
                            status=int(status.get("code", 500)), reason=status.get("message", "")
                        )
                    put(WatchEvent(item["type"], item["object"]))
                put(None)
            except BaseException as exc:
                put(None if closed.is_set() else exc)

        future = loop.run_in_executor(self._executor, pump)
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            closed.set()
            for response in responses:
                with contextlib.suppress(Exception):
                    # Unblocks the pool thread reading it first: close() alone waits for
                    # the reader's buffer lock, i.e. for the next event or bookmark.
                    response.shutdown()
                    response.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(future), timeout=1.0)


# The API server answers a list with PartialObjectMetadataList when asked in this Accept
# header: metadata only (labels, annotations, uid), for CRs too, whatever the objects' size.
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


async def list_workflow_metadata(
    api_client: client.ApiClient,
    executor: ThreadPoolExecutor,
    *,
    label_selector: str | None = None,
    limit: int = 500,
    continue_token: str | None = None,
) -> dict[str, Any]:
    """One page of Workflows cluster-wide as PartialObjectMetadataList (`items[].metadata`),
    for callers that only need to know which objects exist."""
    query: list[tuple[str, Any]] = [("limit", limit)]
    if label_selector:
        query.append(("labelSelector", label_selector))
    if continue_token:
        query.append(("continue", continue_token))
    path = f"{_WORKFLOWS}/{RESOURCE}"
    call = functools.partial(
        api_client.call_api,
        path,
        "GET",
        query_params=query,
        header_params={"Accept": METADATA_LIST_ACCEPT},
        response_type="object",
        auth_settings=["BearerToken"],
        _return_http_data_only=False,
    )
    result: dict[str, Any] = await request(
        executor, server_attributes(api_client), "GET", path, None, call
    )
    return result


@dataclass(frozen=True)
class Page:
    items: list[dict[str, Any]]
    resource_version: str  # the list's version; a watch resumes from the last page's


async def finished_workflow_pages(
    workflows: Workflows,
    namespace: str | None = None,
    *,
    page_size: int = 500,
    label_selector: str | None = None,
) -> AsyncIterator[Page]:
    """Every finished Workflow (server-side selection on Argo's `completed` label), one page
    at a time, so memory stays flat however many exist: the one pager of finished runs
    (watcher, plan, reconcile). `label_selector` narrows it further (`-l`), server-side.

    A long list outlives its continue token (410 with etcd compaction): it carries on with
    the token the server offers; what finished meanwhile a watch or the next pass brings."""
    selector = ",".join(s for s in (COMPLETED_SELECTOR, label_selector) if s)
    token: str | None = None
    while True:
        try:
            page = await workflows.list(
                namespace, label_selector=selector, limit=page_size, continue_token=token
            )
        except ApiException as exc:
            fresh = continue_after_expiry(exc) if exc.status == 410 and token else None
            if fresh is None:
                raise
            token = fresh
            continue
        metadata = page.get("metadata", {})
        yield Page(list(page.get("items", [])), str(metadata.get("resourceVersion", "")))
        token = metadata.get("continue")
        if not token:
            return
