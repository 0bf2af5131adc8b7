"""The hub's streams (docs/fleet.md): every cluster's outcomes (its audit stream) and
lifecycle events, sourced from the cluster's JetStream domain with the cluster named in
each message's subject (`lapse.fleet.<cluster>.audit.>`, `lapse.fleet.<cluster>.events.>`).

JetStream carries them: a source is a consumer the hub keeps in the cluster's domain over
the leaf connection; after a partition it resumes where it stopped, so each message is
stored once (the sequence it reached is the hub's, not anyone's word). The schedules are
never sourced: they live and fire in their own domain only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from nats.js.api import ExternalStream, StorageType, StreamConfig, StreamSource, SubjectTransform

from lapse.config import Streams
from lapse.embedded.fleet_identities import FLEET_PREFIX, deliver_prefix
from lapse.events.subjects import AUDIT_PREFIX, EVENTS_PREFIX

FLEET_AUDIT: Final = "LAPSE_FLEET_AUDIT"
FLEET_EVENTS: Final = "LAPSE_FLEET_EVENTS"
# How long the hub keeps lifecycle events: as long as a cluster does (streams.yaml).
EVENTS_MAX_AGE: Final = timedelta(days=7)


def fleet_subject(cluster: str, what: str) -> str:
    """Where the hub stores `cluster`'s `what` (audit, events): a filter with `.>`."""
    return f"{FLEET_PREFIX}.{cluster}.{what}"


def cluster_of(subject: str) -> str | None:
    """The cluster a hub stream's subject names; None for another subject."""
    prefix = f"{FLEET_PREFIX}."
    if not subject.startswith(prefix):
        return None
    cluster, _, rest = subject[len(prefix) :].partition(".")
    return cluster if cluster and rest else None


def _source(cluster: str, stream: str, prefix: str, what: str) -> StreamSource:
    return StreamSource(
        name=stream,
        external=ExternalStream(
            api=f"$JS.{cluster}.API", deliver=f"{deliver_prefix(cluster)}.{what}"
        ),
        subject_transforms=[
            SubjectTransform(src=f"{prefix}.>", dest=f"{fleet_subject(cluster, what)}.>")
        ],
    )


def hub_stream_configs(
    clusters: tuple[str, ...], *, audit_max_age: timedelta, streams: Streams | None = None
) -> list[StreamConfig]:
    """The hub's two streams, each sourcing every cluster in `clusters` (the clusters'
    stream names: `streams`, lapse's defaults unless renamed alike in every cluster)."""
    streams = streams or Streams()
    return [
        StreamConfig(
            name=FLEET_AUDIT,
            description="Every cluster's outcomes (their audit streams), named by cluster.",
            sources=[_source(c, streams.audit, AUDIT_PREFIX, "audit") for c in clusters],
            storage=StorageType.FILE,
            max_age=audit_max_age.total_seconds(),
            # Read in batches by direct get, as a cluster's audit stream (read_stream).
            allow_direct=True,
        ),
        StreamConfig(
            name=FLEET_EVENTS,
            description="Every cluster's run lifecycle events, named by cluster.",
            sources=[_source(c, streams.events, EVENTS_PREFIX, "events") for c in clusters],
            storage=StorageType.FILE,
            max_age=EVENTS_MAX_AGE.total_seconds(),
            allow_direct=True,
        ),
    ]
