"""Run objects of any configured kind (events/kinds.py): get, guarded delete, list,
watch, and the one pager of finished objects. Also the planner's ObjectFetcher: a fresh
GET of an object an input only references (ApiServerSource Reference mode, a Kubernetes
Event announcing a finished Workflow).
"""

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

from lapse.edges.kubernetes.client import (
    continue_after_expiry,
    request,
    request_on_loop,
    request_timeout_of,
    server_attributes,
    timeout_kwargs,
)
from lapse.edges.kubernetes.loop_http import loop_http_of
from lapse.edges.kubernetes.own_deletions import OwnDeletions
from lapse.events.kinds import DEFAULT_KINDS, KindSet, KindSpec
from lapse.telemetry import count_kubernetes_request


def _paths(kind: KindSpec) -> tuple[str, str, str]:
    """(cluster-wide list, namespaced collection, one object) URL templates."""
    base = f"/apis/{kind.group}/{kind.version}"
    namespaced = base + "/namespaces/{namespace}/" + kind.resource
    return f"{base}/{kind.resource}", namespaced, namespaced + "/{name}"


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class KubeObjects:
    """Objects of the configured kinds, as plain dicts (the shape the API returns).

    Every call names its kind; `kinds` is only used to find one by apiVersion and kind
    (`fetch`). The group/version/resource path works for any API group (batch/v1 too).
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        executor: ThreadPoolExecutor,
        kinds: KindSet = DEFAULT_KINDS,
        own_deletions: OwnDeletions | None = None,
    ) -> None:
        self._api = client.CustomObjectsApi(api_client)
        self._executor = executor
        self.api_client = api_client  # for the calls outside custom objects (namespaces)
        self.executor = executor
        self._server = server_attributes(api_client)
        # Which API server this is (its URL): resourceVersions are only comparable within one.
        self.cluster = str(api_client.configuration.host)
        self.kinds = kinds
        # Shared by every KubeObjects of one process (lapse.runtime.resources), so that
        # its watcher knows the deletions its reaper made.
        self.own_deletions = own_deletions if own_deletions is not None else OwnDeletions()

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

    async def create(self, kind: KindSpec, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", _paths(kind)[1], namespace,
            self._api.create_namespaced_custom_object_with_http_info,
            kind.group, kind.version, namespace, kind.resource, body,
        )  # fmt: skip
        return result

    async def replace(
        self, kind: KindSpec, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "PUT", _paths(kind)[2], namespace,
            self._api.replace_namespaced_custom_object_with_http_info,
            kind.group, kind.version, namespace, kind.resource, name, body,
        )  # fmt: skip
        return result

    async def replace_status(
        self, kind: KindSpec, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """PUT the status subresource (kinds whose CRD has one: Jobs, Tekton runs)."""
        result: dict[str, Any] = await self._call(
            "PUT", _paths(kind)[2] + "/status", namespace,
            self._api.replace_namespaced_custom_object_status_with_http_info,
            kind.group, kind.version, namespace, kind.resource, name, body,
        )  # fmt: skip
        return result

    async def patch_status(
        self, kind: KindSpec, namespace: str | None, name: str, status: dict[str, Any]
    ) -> None:
        """Merge-patch the status subresource (lapse's own policy objects; `namespace` None
        for a cluster-scoped one). Raises ApiException (404 once the object is gone)."""
        body = {"status": status}
        cluster, _, one = _paths(kind)
        if namespace is None:
            await self._call(
                "PATCH", cluster + "/{name}/status", None,
                self._api.patch_cluster_custom_object_status_with_http_info,
                kind.group, kind.version, kind.resource, name, body,
            )  # fmt: skip
            return
        await self._call(
            "PATCH", one + "/status", namespace,
            self._api.patch_namespaced_custom_object_status_with_http_info,
            kind.group, kind.version, namespace, kind.resource, name, body,
        )  # fmt: skip

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        """The current object, or None when it does not exist."""
        try:
            result: dict[str, Any] = await self._call(
                "GET", _paths(kind)[2], namespace,
                self._api.get_namespaced_custom_object_with_http_info,
                kind.group, kind.version, namespace, kind.resource, name,
                **timeout_kwargs(request_timeout),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The ObjectFetcher port: a referenced object as it is now, or None (404). A kind
        lapse is not configured for is read by its lower-case plural, which holds for the
        built-in kinds and for Kubernetes Events' involved objects."""
        spec = self.kinds.find(api_version, kind)
        if spec is None:
            spec = KindSpec(
                name="referenced",
                api_version=api_version,
                kind=kind,
                resource=kind.lower() + "s",
                finished={"phases": ["-"]},
            )
        else:
            spec = spec.model_copy(update={"api_version": api_version})
        return await self.get(spec, namespace, name)

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
        """DELETE guarded by preconditions: the API server refuses (409) unless the object
        still has this uid (and resourceVersion, when given). Raises ApiException."""
        # A plain body, not the client's V1DeleteOptions: each of its models builds a whole
        # client Configuration, whose logger set-up walks every logger of the process
        # (about 80 µs of CPU a DELETE, on the event loop's thread).
        preconditions = {"uid": uid}
        if resource_version is not None:
            preconditions["resourceVersion"] = resource_version
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": preconditions,
            "propagationPolicy": propagation_policy,
        }
        self.own_deletions.sending(uid)
        template = _paths(kind)[2]
        http = loop_http_of(self.api_client)
        try:
            if http is None:
                await self._call(
                    "DELETE", template, namespace,
                    self._api.delete_namespaced_custom_object_with_http_info,
                    kind.group, kind.version, namespace, kind.resource, name, body=body,
                    **timeout_kwargs(request_timeout),
                )  # fmt: skip
            else:  # from the event loop: no thread hop, no client machinery (loop_http.py)
                path = template.format(namespace=namespace, name=name)
                await request_on_loop(
                    http, self.api_client, self._server, "DELETE", template, namespace,
                    path, body, request_timeout,
                )  # fmt: skip
        except BaseException:
            self.own_deletions.failed(uid)
            raise

    async def list_page(
        self,
        kind: KindSpec,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        limit: int = 500,
        continue_token: str | None = None,
        request_timeout: float | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"limit": limit, **timeout_kwargs(request_timeout)}
        if label_selector:
            kwargs["label_selector"] = label_selector
        if continue_token:
            kwargs["_continue"] = continue_token
        cluster, namespaced, _ = _paths(kind)
        result: dict[str, Any]
        if namespace is None:
            result = await self._call(
                "GET", cluster, None,
                self._api.list_cluster_custom_object_with_http_info,
                kind.group, kind.version, kind.resource, **kwargs,
            )  # fmt: skip
        else:
            result = await self._call(
                "GET", namespaced, namespace,
                self._api.list_namespaced_custom_object_with_http_info,
                kind.group, kind.version, namespace, kind.resource, **kwargs,
            )  # fmt: skip
        return result

    async def list_items(
        self,
        kind: KindSpec,
        namespace: str,
        *,
        label_selector: str,
        request_timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """Every matching object in one namespace (a gate's children: a handful)."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = await self.list_page(
                kind,
                namespace,
                label_selector=label_selector,
                continue_token=token,
                request_timeout=request_timeout,
            )
            items.extend(page.get("items", []))
            token = page.get("metadata", {}).get("continue")
            if not token:
                return items

    async def watch(
        self,
        kind: KindSpec,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """Cluster-wide watch with bookmarks. A 410 Gone surfaces as ApiException(410).

        The response is read on a pool thread; leaving the iterator closes the response,
        which ends that thread at once instead of at the next event.

        The server ends the watch after `timeout_seconds`; the client waits for the next
        byte a request timeout longer than that, and no more: an API server black-holed
        mid-watch (nothing refused, nothing answered) ends the watch with urllib3's
        ReadTimeoutError, a transient fault (lapse.runtime.outages), instead of never.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue(maxsize=1000)
        request_timeout = request_timeout_of(self.api_client)
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
            "_request_timeout": (request_timeout, timeout_seconds + request_timeout),
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
                response = self._api.list_cluster_custom_object(
                    kind.group, kind.version, kind.resource, **kwargs
                )
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


async def list_metadata(
    api_client: client.ApiClient,
    executor: ThreadPoolExecutor,
    kind: KindSpec,
    *,
    label_selector: str | None = None,
    limit: int = 500,
    continue_token: str | None = None,
) -> dict[str, Any]:
    """One page of `kind` cluster-wide as PartialObjectMetadataList (`items[].metadata`),
    for callers that only need to know which objects exist."""
    query: list[tuple[str, Any]] = [("limit", limit)]
    if label_selector:
        query.append(("labelSelector", label_selector))
    if continue_token:
        query.append(("continue", continue_token))
    path = _paths(kind)[0]
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


async def finished_pages(
    objects: KubeObjects,
    kind: KindSpec,
    namespace: str | None = None,
    *,
    page_size: int = 500,
    label_selector: str | None = None,
) -> AsyncIterator[Page]:
    """Every object of `kind` that may be finished, one page at a time, so memory stays
    flat however many exist: the one pager of finished runs (watcher, plan, reconcile).
    Where the kind has a `finished_selector` (Argo's `completed` label) only finished ones
    are listed, server-side; otherwise every object is, and the caller's adapter ignores
    the unfinished. `label_selector` narrows it further (`-l`), server-side.

    A long list outlives its continue token (410 with etcd compaction): it carries on with
    the token the server offers; what finished meanwhile a watch or the next pass brings."""
    selector = ",".join(s for s in (kind.finished_selector, label_selector) if s)
    token: str | None = None
    while True:
        try:
            page = await objects.list_page(
                kind, namespace, label_selector=selector, limit=page_size, continue_token=token
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
