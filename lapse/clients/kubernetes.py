"""The Kubernetes edge: one API client, and async access to Argo Workflows.

The official client is synchronous, so every call goes through a bounded thread pool and
never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

WORKFLOW_GROUP = "argoproj.io"
WORKFLOW_VERSION = "v1alpha1"
WORKFLOW_PLURAL = "workflows"

T = TypeVar("T")


def load_api_client(
    kubeconfig: str | None = None, context: str | None = None, in_cluster: bool = False
) -> client.ApiClient:
    if in_cluster:
        config.load_incluster_config()
        return client.ApiClient()
    configuration = client.Configuration()
    config.load_kube_config(
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return client.ApiClient(configuration)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class Workflows:
    """Argo Workflow custom resources, as plain dicts (the shape the API returns)."""

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self._api = client.CustomObjectsApi(api_client)
        self._executor = executor

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            self._api.create_namespaced_custom_object,
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, body,
        )  # fmt: skip
        return result

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            self._api.replace_namespaced_custom_object,
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name, body,
        )  # fmt: skip
        return result

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The current object, or None when it does not exist."""
        try:
            result: dict[str, Any] = await self._call(
                self._api.get_namespaced_custom_object,
                WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name,
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
    ) -> None:
        """DELETE guarded by preconditions: the API server refuses (409) unless the object
        still has this uid (and resourceVersion, when given). Raises ApiException."""
        preconditions = client.V1Preconditions(uid=uid, resource_version=resource_version)
        body = client.V1DeleteOptions(
            preconditions=preconditions, propagation_policy=propagation_policy
        )
        await self._call(
            self._api.delete_namespaced_custom_object,
            WORKFLOW_GROUP, WORKFLOW_VERSION, namespace, WORKFLOW_PLURAL, name, body=body,
        )  # fmt: skip

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
                self._api.list_cluster_custom_object,
                WORKFLOW_GROUP, WORKFLOW_VERSION, WORKFLOW_PLURAL, **kwargs,
            )  # fmt: skip
        else:
            result = await self._call(
                self._api.list_namespaced_custom_object,
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
        """Cluster-wide watch with bookmarks. A 410 Gone surfaces as ApiException(410)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue(maxsize=1000)
        watcher = watch.Watch()
        kwargs: dict[str, Any] = {
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
        }
        if resource_version:
            kwargs["resource_version"] = resource_version
        if label_selector:
            kwargs["label_selector"] = label_selector

        def pump() -> None:
            try:
                for item in watcher.stream(
                    self._api.list_cluster_custom_object,
                    WORKFLOW_GROUP, WORKFLOW_VERSION, WORKFLOW_PLURAL, **kwargs,
                ):  # fmt: skip
                    raw = item["raw_object"]
                    if item["type"] == "ERROR":
                        code = int(raw.get("code", 500))
                        raise ApiException(status=code, reason=raw.get("message", ""))
                    asyncio.run_coroutine_threadsafe(
                        queue.put(WatchEvent(item["type"], raw)), loop
                    ).result()
                asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()
            except BaseException as exc:  # handed to the consumer, re-raised there
                with contextlib.suppress(RuntimeError):
                    asyncio.run_coroutine_threadsafe(queue.put(exc), loop).result()

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
            watcher.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(future), timeout=0.1)
