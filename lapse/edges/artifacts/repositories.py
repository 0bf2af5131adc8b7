"""Argo's artifact repositories, read from their ConfigMaps (`RepositoryReader`): the
bucket of a Workflow's repository, for recorded artifacts that name none (Argo < 3.1 does
not copy the repository into `status.artifactRepositoryRef`).

The ConfigMap's key (the ref's, else the one its annotation
`workflows.argoproj.io/default-artifact-repository` names, else `default-v1`) holds the
repository as YAML: `s3: {bucket: ...}`, `gcs: {bucket: ...}`, `azure: {container: ...}`.
A ConfigMap that is gone or unreadable yields nothing: those artifacts are then outside
every store and never deleted.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import request, server_attributes
from lapse.functions.ports import RetryLater

DEFAULT_KEY_ANNOTATION: Final = "workflows.argoproj.io/default-artifact-repository"
_BUCKETS: Final = (("s3", "bucket"), ("gcs", "bucket"), ("azure", "container"))


log = logging.getLogger(__name__)
TEMPLATE: Final = "/api/v1/namespaces/{namespace}/configmaps/{name}"


class ConfigMapRepositories:
    """`lapse.functions.artifact_reaper.ports.RepositoryReader` on the Kubernetes API (needs `get`
    on ConfigMaps in the Workflows' namespaces; without it the artifacts that name no
    bucket stay outside every store, and the log says why)."""

    def __init__(self, api_client: client.ApiClient, executor: ThreadPoolExecutor) -> None:
        self._api = client.CoreV1Api(api_client)
        self._executor = executor
        self._server = server_attributes(api_client)

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]:
        call = functools.partial(
            self._api.read_namespaced_config_map_with_http_info, config_map, namespace
        )
        try:
            obj = await request(self._executor, self._server, "GET", TEMPLATE, namespace, call)
        except ApiException as exc:
            status = exc.status or 0
            if status in (0, 408, 429) or status >= 500:
                raise RetryLater(
                    f"reading ConfigMap {namespace}/{config_map}: HTTP {status}"
                ) from exc
            if status != 404:
                log.warning(
                    "artifact repository ConfigMap %s/%s unreadable (HTTP %s): the artifacts "
                    "it holds are not captured",
                    namespace, config_map, status,
                )  # fmt: skip
            return {}
        annotations = obj.metadata.annotations or {}
        key = key or annotations.get(DEFAULT_KEY_ANNOTATION) or "default-v1"
        try:
            repository = yaml.safe_load((obj.data or {}).get(key) or "")
        except yaml.YAMLError:
            return {}
        if not isinstance(repository, dict):
            return {}
        found: dict[str, str] = {}
        for provider, field in _BUCKETS:
            location = repository.get(provider)
            if isinstance(location, dict) and isinstance(location.get(field), str):
                found[provider] = location[field]
        return found
