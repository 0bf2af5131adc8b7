"""The Kubernetes edge: one API client, async access to Argo Workflows, Kubernetes Events.

The official client is synchronous, so every call goes through a bounded thread pool and
never blocks the event loop. Handlers never see the client's exceptions: `api_failure`
turns them into a status and a one-line message (`ApiCallFailure`).

Every request is counted (`lapse.kubernetes.requests`, and per deletion), and inside a
trace it is a CLIENT span named after its URL template, a child of the reaper's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from opentelemetry.util.types import AttributeValue

from lapse.telemetry import client_span, count_kubernetes_request, end_client_span
from lapse.telemetry.names import HTTP_METHOD, SERVER_ADDRESS, SERVER_PORT, URL_TEMPLATE

WORKFLOW_GROUP = "argoproj.io"
WORKFLOW_VERSION = "v1alpha1"
WORKFLOW_PLURAL = "workflows"
_WORKFLOWS = f"/apis/{WORKFLOW_GROUP}/{WORKFLOW_VERSION}"
_NAMESPACED = _WORKFLOWS + "/namespaces/{namespace}/" + WORKFLOW_PLURAL
_ONE = _NAMESPACED + "/{name}"
K8S_NAMESPACE = "k8s.namespace.name"


def load_api_client(
    kubeconfig: str | None = None,
    context: str | None = None,
    in_cluster: bool = False,
    *,
    pool_size: int = 16,
) -> client.ApiClient:
    """`pool_size` should match the threads making calls: urllib3's default pool (10) is
    smaller than lapse's thread pool, and each call past it pays a new TLS handshake."""
    configuration = client.Configuration()
    if in_cluster:
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def continue_after_expiry(exc: ApiException) -> str | None:
    """A list's continue token expires with etcd compaction (410). The server then offers
    a token that continues without the list's snapshot; None if it offered none."""
    try:
        status = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return None
    token = status.get("metadata", {}).get("continue") if isinstance(status, dict) else None
    return token if isinstance(token, str) and token else None


@dataclass(frozen=True)
class ApiCallFailure:
    """A failed API call: HTTP `status` (None when no response came back), the server's own
    message, and its Retry-After in seconds when it sent one."""

    status: int | None
    message: str
    retry_after: float | None = None


def api_failure(exc: BaseException) -> ApiCallFailure | None:
    """Describe an exception raised by the client, or None if it is not an API or transport
    failure (a bug, which the caller lets propagate)."""
    if isinstance(exc, ApiException):
        return ApiCallFailure(
            exc.status or None, _status_message(exc), _retry_after(exc.headers or {})
        )
    # urllib3 raises its own exceptions (MaxRetryError, timeouts) for connection failures;
    # OSError covers what escapes it (refused sockets, TLS).
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return ApiCallFailure(None, f"{type(exc).__name__}: {exc}")
    return None


def _status_message(exc: ApiException) -> str:
    # The API server answers errors with a Status object whose message is the useful part
    # ("... is forbidden: User x cannot delete resource ..."), not the HTTP reason.
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            status = json.loads(body)
        except ValueError:
            return body[:1000]
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            return str(status["message"])
    return str(exc.reason or f"HTTP {exc.status}")


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from the API server, and the default delay is fine


def _server(api_client: client.ApiClient) -> dict[str, AttributeValue]:
    url = urlsplit(str(api_client.configuration.host))
    attributes: dict[str, AttributeValue] = {SERVER_ADDRESS: url.hostname or ""}
    if url.port or url.scheme:
        attributes[SERVER_PORT] = url.port or (443 if url.scheme == "https" else 80)
    return attributes


async def _request(
    executor: ThreadPoolExecutor,
    server: dict[str, AttributeValue],
    method: str,
    template: str,
    namespace: str | None,
    call: Callable[[], tuple[Any, int, Any]],
) -> Any:
    """Run one `*_with_http_info` call on the pool: counted, and a CLIENT span in a trace."""
    attributes: dict[str, AttributeValue] = {HTTP_METHOD: method, URL_TEMPLATE: template, **server}
    if namespace is not None:
        attributes[K8S_NAMESPACE] = namespace
    span = client_span(f"{method} {template}", attributes)
    status: int | None = None
    error: str | None = None
    try:
        data, status, _ = await asyncio.get_running_loop().run_in_executor(executor, call)
        return data
    except ApiException as exc:
        status = exc.status or None
        error = str(status) if status else type(exc).__name__
        raise
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        count_kubernetes_request(method, status)
        end_client_span(span, status=status, error=error)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class Workflows:
    """Argo Workflow custom resources, as plain dicts (the shape the API returns)."""

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self._api = client.CustomObjectsApi(api_client)
        self._executor = executor
        self._server = _server(api_client)

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
        return await _request(self._executor, self._server, method, template, namespace, call)

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", _NAMESPACED, namespace,
            self._api.create_namespaced_custom_object_with_http_info,
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, body,
        )  # fmt: skip
        return result

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "PUT", _ONE, namespace,
            self._api.replace_namespaced_custom_object_with_http_info,
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name, body,
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
                WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name,
                **_timeout(request_timeout),
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
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name, body=body,
            **_timeout(request_timeout),
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
                "GET", f"{_WORKFLOWS}/{WORKFLOW_PLURAL}", None,
                self._api.list_cluster_custom_object_with_http_info,
                WORKFLOW_GROUP, WORKFLOW_VERSION, WORKFLOW_PLURAL, **kwargs,
            )  # fmt: skip
        else:
            result = await self._call(
                "GET", _NAMESPACED, namespace,
                self._api.list_namespaced_custom_object_with_http_info,
                WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, **kwargs,
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
                response = self._api.list_cluster_custom_object(
                    WORKFLOW_GROUP, WORKFLOW_VERSION, WORKFLOW_PLURAL, **kwargs
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


def _timeout(seconds: float | None) -> dict[str, Any]:
    """The client's per-request timeout keyword, when one is wanted."""
    return {"_request_timeout": seconds} if seconds is not None else {}


class KubeEvents:
    """Writes core/v1 Events, the ones `kubectl describe` and `kubectl get events` show."""

    # Named the way client-go names them, <object>.<unique>, within the 253-char limit.
    _NAME_LIMIT = 253

    def __init__(
        self,
        api_client: client.ApiClient,
        executor: ThreadPoolExecutor,
        *,
        component: str = "lapse",
        instance: str | None = None,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._executor = executor
        self._server = _server(api_client)
        self._component = component
        self._instance = instance or component

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
    ) -> None:
        now = datetime.now(UTC)
        suffix = secrets.token_hex(8)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{name[: self._NAME_LIMIT - len(suffix) - 1]}.{suffix}", namespace=namespace
            ),
            involved_object=client.V1ObjectReference(
                api_version=api_version, kind=kind, name=name, namespace=namespace, uid=uid
            ),
            reason=reason,
            message=message[:1024],
            type=event_type,
            source=client.V1EventSource(component=self._component),
            reporting_component=self._component,
            reporting_instance=self._instance,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        await _request(
            self._executor,
            self._server,
            "POST",
            "/api/v1/namespaces/{namespace}/events",
            namespace,
            functools.partial(self._api.create_namespaced_event_with_http_info, namespace, event),
        )


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
    path = f"{_WORKFLOWS}/{WORKFLOW_PLURAL}"
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
    result: dict[str, Any] = await _request(executor, _server(api_client), "GET", path, None, call)
    return result
