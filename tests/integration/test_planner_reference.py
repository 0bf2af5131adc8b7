"""Reference-mode inputs (Knative ApiServerSource `ref.*` events) are planned from a fresh GET.

Real kube-apiserver and NATS: the planner built by the registry, as `lapse up` and the
Knative function build it, reads the referenced Workflow and schedules its deletion.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent
from nats.js import JetStreamContext

from lapse.config import LapseConfig
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import parse_payload
from lapse.events.models import CleanupFailed, CleanupScheduled
from lapse.events.run import Target
from lapse.events.types import EventType
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from tests.conftest import KubeStack
from tests.unit.test_object_reaper_verdict import argo_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]


def reference_event(obj: dict[str, Any], *, kind: str = "Workflow") -> BaseCloudEvent:
    metadata = obj["metadata"]
    return CloudEvent(
        attributes={
            "type": "dev.knative.apiserver.ref.update",
            "source": "https://kubernetes.default.svc",
            "id": f"ref-{metadata['name']}",
        },
        data={
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": kind,
            "name": metadata["name"],
            "namespace": metadata["namespace"],
        },
    )


@pytest.fixture
def resources(kube: KubeStack, nats_server: EmbeddedNats) -> Resources:
    config = LapseConfig.model_validate({"kubernetes": {"kubeconfig": str(kube.kubeconfig)}})
    return Resources(config, nats_url=nats_server.url)


async def test_a_reference_is_read_then_planned(
    kube: KubeStack, lapse_streams: JetStreamContext, resources: Resources
) -> None:
    ns = kube.namespace("planner-reference")
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    body = argo_workflow("by-reference", namespace=ns, finished_at=finished)
    body["metadata"]["annotations"] = {"lapse.dev/ttl": "1h"}
    wf = await kube.workflows.create(ns, body)
    async with resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None
        produced = await planner.handle(reference_event(wf))
    scheduled = [
        parse_payload(e, CleanupScheduled)
        for e in produced
        if e.get_type() == EventType.CLEANUP_SCHEDULED
    ]
    assert [s.target for s in scheduled] == [Target.KUBERNETES]
    assert scheduled[0].run.uid == wf["metadata"]["uid"]
    assert scheduled[0].deadline == finished + timedelta(hours=1)
    pending = await NatsScheduleStore(lapse_streams, resources.config.nats.streams).get(
        Target.KUBERNETES, wf["metadata"]["uid"]
    )
    assert pending is not None and pending.deadline == finished + timedelta(hours=1)


async def test_a_reference_to_an_object_that_is_gone_plans_nothing(
    kube: KubeStack, lapse_streams: JetStreamContext, resources: Resources
) -> None:
    ns = kube.namespace("planner-reference")
    gone = argo_workflow("never-created", namespace=ns, finished_at=datetime.now(UTC))
    async with resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None
        produced = await planner.handle(reference_event(gone))
    assert produced == []


async def test_a_reference_to_an_unsupported_kind_is_refused_with_its_reason(
    kube: KubeStack, lapse_streams: JetStreamContext, resources: Resources
) -> None:
    ns = kube.namespace("planner-reference")
    wf = argo_workflow("template", namespace=ns, finished_at=datetime.now(UTC))
    async with resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None
        produced = await planner.handle(reference_event(wf, kind="WorkflowTemplate"))
    assert [e.get_type() for e in produced] == [EventType.CLEANUP_FAILED]
    assert "WorkflowTemplate" in parse_payload(produced[0], CleanupFailed).reason
