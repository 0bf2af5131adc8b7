"""`-l SELECTOR`: the user's label selector, added to every Workflow list lapse makes, so
the API server does the selecting and the one pager of finished runs (and reconcile's
pass over it) is reused as it is."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client

from lapse.config import LapseConfig
from lapse.edges.kubernetes import Workflows
from lapse.runtime.resources import Resources


class SelectedWorkflows(Workflows):
    def __init__(
        self, api_client: client.ApiClient, executor: ThreadPoolExecutor, selector: str
    ) -> None:
        super().__init__(api_client, executor)
        self._selector = selector

    async def list(
        self,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        limit: int = 500,
        continue_token: str | None = None,
    ) -> dict[str, Any]:
        combined = ",".join(s for s in (label_selector, self._selector) if s)
        return await super().list(
            namespace, label_selector=combined, limit=limit, continue_token=continue_token
        )


class SelectedResources(Resources):
    """Resources whose Workflows carry `selector` (none: exactly `Resources`)."""

    def __init__(self, config: LapseConfig, selector: str | None) -> None:
        super().__init__(config)
        self._selector = selector

    def workflows(self) -> Workflows:
        if not self._selector:
            return super().workflows()
        return SelectedWorkflows(self.kube_client(), self.kube_executor(), self._selector)
