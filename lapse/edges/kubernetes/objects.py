"""The ObjectFetcher port: a fresh GET of any object an input only references.

Knative's ApiServerSource in Reference mode, and a Kubernetes Event announcing a finished
Workflow, name an object without its body; the planner reads it here before planning.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import request, server_attributes


def resource_path(api_version: str, kind: str, namespace: str, name: str) -> tuple[str, str]:
    """(template, path) of a namespaced object. The resource is the kind's lower-case
    plural, which holds for every kind lapse adapts (workflows, pipelineruns, jobs)."""
    group, _, version = api_version.rpartition("/")
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    resource = kind.lower() + "s"
    template = f"{base}/namespaces/{{namespace}}/{resource}/{{name}}"
    return template, f"{base}/namespaces/{namespace}/{resource}/{name}"


class KubeObjects:
    """Reads objects by apiVersion, kind, namespace and name, as plain dicts."""

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self._api_client = api_client
        self._executor = executor
        self._server = server_attributes(api_client)

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The object as it is now, or None when it does not exist."""
        template, path = resource_path(api_version, kind, namespace, name)
        call = functools.partial(
            self._api_client.call_api,
            path,
            "GET",
            response_type="object",
            auth_settings=["BearerToken"],
            _return_http_data_only=False,
        )
        try:
            result: dict[str, Any] = await request(
                self._executor, self._server, "GET", template, namespace, call
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result
