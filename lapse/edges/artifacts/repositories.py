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

from typing import Any, Final, Protocol

import yaml

DEFAULT_KEY_ANNOTATION: Final = "workflows.argoproj.io/default-artifact-repository"
_BUCKETS: Final = (("s3", "bucket"), ("gcs", "bucket"), ("azure", "container"))


class _Fetcher(Protocol):
    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None: ...


class ConfigMapRepositories:
    def __init__(self, fetcher: _Fetcher) -> None:
        self._fetcher = fetcher

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]:
        obj = await self._fetcher.fetch("v1", "ConfigMap", namespace, config_map)
        if obj is None:
            return {}
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        key = key or annotations.get(DEFAULT_KEY_ANNOTATION) or "default-v1"
        try:
            repository = yaml.safe_load((obj.get("data") or {}).get(key) or "")
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
