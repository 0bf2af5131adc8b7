"""What the functions' factories share: the NATS-backed limits and the artifact captures."""

from __future__ import annotations

from lapse.edges.artifacts.captures import NatsCaptures
from lapse.edges.limits import NatsBrake, NatsRateLimit, limits_bucket
from lapse.runtime.resources import Resources


async def captures(resources: Resources) -> NatsCaptures:
    """Each run's capture of its artifacts (the `LAPSE_ARTIFACTS` bucket)."""
    return NatsCaptures(await resources.jetstream(), replicas=resources.config.nats.replicas)


async def limits(resources: Resources, scope: str) -> tuple[NatsRateLimit, NatsBrake]:
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
