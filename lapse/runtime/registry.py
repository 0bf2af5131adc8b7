"""Which handler each function name runs, and how it is built from the resources.

The single registry both runtimes use: `lapse serve NAME` / a Knative function folder, and
the local dispatcher of `lapse up`. A factory returns None when the configuration gives
the function nothing to do (no database target enabled for the row-reaper). Whatever it
returns runs inside its function span, with its metrics (`InstrumentedHandler`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.config import ConfigException

from lapse.edges.artifacts import (
    ConfigMapRepositories,
    KubeLiveRuns,
    NatsCaptures,
    ObstoreStores,
    recording_kinds,
)
from lapse.edges.kubernetes import KubeEvents, api_failure
from lapse.edges.kubernetes.reaping import ReapedObjects
from lapse.edges.limits import ARTIFACTS, OBJECTS, ROWS, NatsBrake, NatsRateLimit, limits_bucket
from lapse.edges.rows import CoalescingRowStore, DatabaseUnavailable, SqlRowStore, open_row_store
from lapse.events.kinds import KindSpec
from lapse.functions.artifact_reaper import ArtifactReaper
from lapse.functions.artifact_reaper.metadata import CaptureMetadata
from lapse.functions.object_reaper import ObjectReaper
from lapse.functions.ports import Handler, RetryLater
from lapse.functions.reaping.failures import Unavailable, retry_delay, transient
from lapse.functions.row_reaper import RowReaper, targets_for
from lapse.functions.ttl_planner import Planner
from lapse.functions.ttl_planner.artifacts import ArtifactPlanning
from lapse.runtime.outages import Backoff
from lapse.runtime.resources import Resources
from lapse.telemetry.handling import instrumented

Factory = Callable[[Resources], Awaitable[Handler | None]]

log = logging.getLogger(__name__)


class _ReferencedObjects:
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
            waited = _waited_out(exc, f"read {kind} {namespace}/{name}")
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


def _waited_out(exc: Exception, what: str) -> RetryLater | None:
    """The `RetryLater` a transient API failure (no response, 408, 429, 5xx) is delivered
    again for; None for anything else, which the caller re-raises as it is."""
    failure = api_failure(exc)
    if failure is None:
        return None
    if not transient(failure.status):
        return None
    return Unavailable(f"cannot {what} yet: {failure.message}", retry_delay(failure.retry_after))


class _Repositories:
    """Argo's artifact repository ConfigMaps, connected on first use (like the fetcher)."""

    def __init__(self, resources: Resources) -> None:
        self._resources = resources
        self._reader: ConfigMapRepositories | None = None

    async def buckets(self, namespace: str, config_map: str, key: str | None) -> dict[str, str]:
        if self._reader is None:
            resources = self._resources
            self._reader = ConfigMapRepositories(resources.kube_client(), resources.kube_executor())
        return await self._reader.buckets(namespace, config_map, key)


async def _ttl_planner(resources: Resources) -> Handler:
    objects = _ReferencedObjects(resources)
    stores = resources.config.artifacts
    artifacts = (
        ArtifactPlanning(
            stores,
            await _captures(resources),
            _Repositories(resources),
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


async def _captures(resources: Resources) -> NatsCaptures:
    return NatsCaptures(await resources.jetstream(), replicas=resources.config.nats.replicas)


async def _artifact_reaper(resources: Resources) -> Handler | None:
    config = resources.config.artifacts
    if not config.stores:
        return None
    for warning in config.warnings():
        log.warning("%s", warning)
    # The artifacts' own limits, counting objects, shared by every artifact-reaper process.
    rate_limit, brake = await _limits(resources, ARTIFACTS)
    stores = ObstoreStores(config, timeout=config.timeout, connect_timeout=config.connect_timeout)
    return ArtifactReaper(
        stores=stores,
        captures=await _captures(resources),
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        config=config,
        safety=resources.config.safety,
        rate_limit=rate_limit,
        brake=brake,
        metadata_expected=resources.config.database.targets.ml_metadata.enabled,
        live=_live_runs(resources),
    )


def _live_runs(resources: Resources) -> KubeLiveRuns | None:
    """What live runs record is kept: read from the API server when something is deleted.
    Without Kubernetes access (a deployment that withholds the reaper's API token or its
    `list` on Workflows: docs/deploy.md, "Artifacts in object storage") only the captured
    runs' keys are kept, and start-up says so."""
    kinds = resources.config.kinds
    if not recording_kinds(kinds):
        return None
    try:
        resources.kube_client()
    except ConfigException as exc:
        log.warning(
            "artifacts: no Kubernetes access (%s): what Running Workflows record is not "
            "read before deleting, only the keys of runs lapse captured are kept; give the "
            "artifact-reaper list on workflows.argoproj.io (docs/deploy.md)",
            exc,
        )
        return None
    return KubeLiveRuns(resources.objects, kinds)


async def _object_reaper(resources: Resources) -> Handler:
    kubernetes = resources.config.kubernetes
    recorder = (
        KubeEvents(resources.kube_client(), resources.kube_executor(), component="lapse")
        if kubernetes.record_events
        else None
    )
    # The rate limit and the brake hold for the deployment: their state is in NATS, shared
    # by every reaper process (lapse/edges/limits.py).
    rate_limit, brake = await _limits(resources, OBJECTS)
    return ObjectReaper(
        rate_limit=rate_limit,
        brake=brake,
        objects=ReapedObjects(resources.objects()),
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        policies=resources.policies(),
        safety=resources.config.safety,
        kinds=resources.config.kinds,
        propagation_policy=kubernetes.propagation_policy,
        request_timeout=kubernetes.request_timeout,
        recorder=recorder,
    )


async def _row_reaper(resources: Resources) -> Handler | None:
    targets = targets_for(resources.config.database.targets)
    if not targets:
        return None
    timeout = resources.config.database.statement_timeout.total_seconds()
    store = await _when_reachable(
        lambda: open_row_store(resources.database(), targets, timeout=timeout)
    )
    for target, schema in store.schemas.items():
        log.info("row-reaper: %s: %s", target, schema)
    # The rows' own limits, shared by every row-reaper process (lapse/edges/limits.py).
    rate_limit, brake = await _limits(resources, ROWS)
    # ML Metadata's account of a KFP run's artifacts goes into the run's capture before its
    # MLMD rows are deleted: afterwards nothing says which URIs were the run's.
    artifacts = resources.config.artifacts
    metadata = (
        CaptureMetadata(await _captures(resources), artifacts)
        if artifacts.stores and resources.config.database.targets.ml_metadata.enabled
        else None
    )
    return RowReaper(
        # Concurrent due events' deletes share transactions (lapse/edges/rows/coalesce.py).
        rows=CoalescingRowStore(store),
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        safety=resources.config.safety,
        rate_limit=rate_limit,
        brake=brake,
        metadata=metadata,
    )


async def _limits(resources: Resources, scope: str) -> tuple[NatsRateLimit, NatsBrake]:
    """The rate limit and the mass-deletion brake for one target, for the deployment."""
    safety = resources.config.safety
    brake = safety.mass_deletion_brake
    window = brake.window.total_seconds()
    kv = await limits_bucket(
        await resources.jetstream(), window=window, replicas=resources.config.nats.replicas
    )
    return (
        NatsRateLimit(kv, safety.max_deletions_per_second, scope=scope),
        NatsBrake(kv, brake.max_due, window, enabled=brake.enabled, scope=scope),
    )


async def _when_reachable(open_store: Callable[[], Awaitable[SqlRowStore]]) -> SqlRowStore:
    """The row store, once the database answers: starting while it is down waits (not
    ready, retrying with back-off) instead of exiting, which in a pod is a crash loop."""
    backoff = Backoff(first=1.0, cap=30.0)
    attempt = 0
    while True:
        try:
            return await open_store()
        except DatabaseUnavailable as exc:
            attempt += 1
            delay = backoff.delay(attempt)
            log.warning("row-reaper: database unreachable (%s); retrying in %.0fs", exc, delay)
            await asyncio.sleep(delay)


FUNCTIONS: dict[str, Factory] = {
    "ttl-planner": _ttl_planner,
    "object-reaper": _object_reaper,
    "row-reaper": _row_reaper,
    "artifact-reaper": _artifact_reaper,
}
# Former names, still accepted (`lapse serve workflow-reaper`) with a deprecation warning.
RENAMED: dict[str, str] = {"workflow-reaper": "object-reaper"}


def current_name(name: str) -> str:
    """The function's name now; a former name is accepted with a deprecation warning."""
    if name in RENAMED:
        log.warning(
            "the function %r is now called %r (it deletes every configured kind); "
            "the old name will be removed in a future release",
            name,
            RENAMED[name],
        )
        return RENAMED[name]
    return name


async def build_handler(name: str, resources: Resources) -> Handler | None:
    name = current_name(name)
    try:
        factory = FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONS))
        raise ValueError(f"unknown function {name!r} (known: {known})") from None
    handler = await factory(resources)
    # A handler that takes batches (the row-reaper) keeps taking them (the dispatcher's fetch).
    return instrumented(name, handler) if handler is not None else None
