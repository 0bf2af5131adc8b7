"""The object-reaper, built from the resources: NATS and Kubernetes."""

from __future__ import annotations

from lapse.edges.kubernetes import KubeEvents
from lapse.edges.kubernetes.reaping import ReapedObjects
from lapse.edges.limits import OBJECTS
from lapse.functions.object_reaper import ObjectReaper
from lapse.functions.ports import Handler
from lapse.runtime.factories.common import limits
from lapse.runtime.resources import Resources


async def build(resources: Resources) -> Handler:
    kubernetes = resources.config.kubernetes
    recorder = (
        KubeEvents(resources.kube_client(), resources.kube_executor(), component="lapse")
        if kubernetes.record_events
        else None
    )
    # The rate limit and the brake hold for the deployment: their state is in NATS, shared
    # by every reaper process (lapse/edges/limits.py).
    rate_limit, brake = await limits(resources, OBJECTS)
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
