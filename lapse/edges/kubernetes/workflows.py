"""Argo Workflows through the generic object edge: the calls tests, the demo and the
benchmarks make without naming a kind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client

from lapse.edges.kubernetes.objects import KubeObjects, Page, WatchEvent, finished_pages
from lapse.events.kinds import ARGO_WORKFLOW


class Workflows:
    """Argo Workflow custom resources, as plain dicts."""

    kind = ARGO_WORKFLOW

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self.objects = KubeObjects(api_client, executor)

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.objects.create(self.kind, namespace, body)

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.objects.replace(self.kind, namespace, name, body)

    async def get(
        self, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        return await self.objects.get(self.kind, namespace, name, request_timeout=request_timeout)

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
        await self.objects.delete(
            self.kind,
            namespace,
            name,
            uid=uid,
            resource_version=resource_version,
            propagation_policy=propagation_policy,
            request_timeout=request_timeout,
        )

    async def list(
        self,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        limit: int = 500,
        continue_token: str | None = None,
    ) -> dict[str, Any]:
        return await self.objects.list_page(
            self.kind,
            namespace,
            label_selector=label_selector,
            limit=limit,
            continue_token=continue_token,
        )

    def watch(
        self,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        return self.objects.watch(
            self.kind,
            resource_version=resource_version,
            label_selector=label_selector,
            timeout_seconds=timeout_seconds,
        )


def finished_workflow_pages(
    workflows: Workflows,
    namespace: str | None = None,
    *,
    page_size: int = 500,
    label_selector: str | None = None,
) -> AsyncIterator[Page]:
    """`finished_pages` for Argo Workflows."""
    return finished_pages(
        workflows.objects,
        workflows.kind,
        namespace,
        page_size=page_size,
        label_selector=label_selector,
    )
