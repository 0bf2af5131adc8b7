"""The ttl-planner, built from the resources: NATS, and Kubernetes on first use."""

from __future__ import annotations

from typing import Any

from lapse.edges.artifacts.repositories import ConfigMapRepositories
from lapse.edges.kubernetes import api_failure
from lapse.edges.kubernetes.reaping import ReapedObjects
from lapse.events.kinds import KindSpec
from lapse.functions.ports import Handler, RetryLater
from lapse.functions.reaping.failures import Unavailable, retry_delay, transient
from lapse.functions.ttl_planner import Planner
from lapse.functions.ttl_planner.artifacts import ArtifactPlanning
from lapse.runtime.factories.common import captures
from lapse.runtime.resources import Resources


class ReferencedObjects:
    """The planner's ObjectFetcher and ObjectLister, connected on first use: only inputs
    that reference an object (ApiServerSource Reference mode, a Kubernetes Event) and
    keep_last groups need Kubernetes access."""

    def __init__(self, resources: Resources) -> None:
        self._resources = resources

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        try:
            return await self._resources.objects().fetch(api_version, kind, namespace, name)
        except Exception as exc:
            # An outage is waited out: a claim checked against an API server that does not
            # answer is neither believed nor refused, and never dead-lettered for it.
            waited = waited_out(exc, f"read {kind} {namespace}/{name}")
            if waited is None:
                raise
            raise waited from exc

    async def list_items(
        self,
        kind: KindSpec,
        namespace: str,
        *,
        label_selector: str,
        request_timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        # The object reaper's lister (edges/kubernetes/reaping.py): an outage is an
        # `Unavailable` (a RetryLater, waited out), anything else a `TargetFailure` naming
        # what to check (a 403: the RBAC verb), which the planner reports as it is.
        lister = ReapedObjects(self._resources.objects())
        return await lister.list_items(
            kind, namespace, label_selector=label_selector, request_timeout=request_timeout
        )


def waited_out(exc: Exception, what: str) -> RetryLater | None:
    """The `RetryLater` a transient API failure (no response, 408, 429, 5xx) is delivered
    again for; None for anything else, which the caller re-raises as it is."""
    failure = api_failure(exc)
    if failure is None:
        return None
    if not transient(failure.status):
        return None
    return Unavailable(f"cannot {what} yet: {failure.message}", retry_delay(failure.retry_after))


class Repositories:
    """Argo's artifact repository ConfigMaps, connected on first use (like the fetcher)."""

    def __init__(self, resources: Resources) -> None:
        self._resources = resources
        self._reader: ConfigMapRepositories | None = None

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]:
        if self._reader is None:
            resources = self._resources
            self._reader = ConfigMapRepositories(resources.kube_client(), resources.kube_executor())
        return await self._reader.buckets(namespace, config_map, key)


async def build(resources: Resources) -> Handler:
    objects = ReferencedObjects(resources)
    stores = resources.config.artifacts
    artifacts = (
        ArtifactPlanning(
            stores,
            await captures(resources),
            Repositories(resources),
        )
        if stores.stores
        else None
    )
    return Planner(
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        policies=resources.policies(),
        kinds=resources.config.kinds,
        fetcher=objects,
        lister=objects,
        artifacts=artifacts,
    )
