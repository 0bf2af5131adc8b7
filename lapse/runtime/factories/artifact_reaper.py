"""The artifact-reaper, built from the resources: NATS, the object stores, and Kubernetes
(what live runs record) when the configuration grants it."""

from __future__ import annotations

import logging

from kubernetes.config import ConfigException

from lapse.edges.artifacts.live import KubeLiveRuns, recording_kinds
from lapse.edges.artifacts.stores import ObstoreStores
from lapse.edges.limits import ARTIFACTS
from lapse.functions.artifact_reaper import ArtifactReaper
from lapse.functions.ports import Handler
from lapse.runtime.factories.common import captures, limits
from lapse.runtime.resources import Resources

log = logging.getLogger(__name__)


async def build(resources: Resources) -> Handler | None:
    config = resources.config.artifacts
    if not config.stores:
        return None
    for warning in config.warnings():
        log.warning("%s", warning)
    # The artifacts' own limits, counting objects, shared by every artifact-reaper process.
    rate_limit, brake = await limits(resources, ARTIFACTS)
    stores = ObstoreStores(config, timeout=config.timeout, connect_timeout=config.connect_timeout)
    return ArtifactReaper(
        stores=stores,
        captures=await captures(resources),
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        config=config,
        safety=resources.config.safety,
        rate_limit=rate_limit,
        brake=brake,
        metadata_expected=resources.config.database.targets.ml_metadata.enabled,
        live=live_runs(resources),
    )


def live_runs(resources: Resources) -> KubeLiveRuns | None:
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
