"""The planner's keep_last count against a real kube-apiserver and NATS: the planner the
registry builds (as `lapse up` and the Knative function do) lists the finished run's group,
puts the older run it counts out at the moment it was pushed out, and withdraws the
Kubernetes deadline of a run another process's count has already deleted."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema
import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext

from lapse.config import LapseConfig
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.adapters import adapt_object
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupCancelled, CleanupCompleted, CleanupScheduled, RunFinished
from lapse.events.run import Target
from lapse.events.schemas import load_schema
from lapse.events.types import EventType, Outcome
from lapse.functions.trust import Trust
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from tests.conftest import KubeStack
from tests.unit.test_object_reaper_verdict import argo_workflow, due_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

CRON = "workflows.argoproj.io/cron-workflow"
NOW = datetime.now(UTC).replace(microsecond=0)


@pytest.fixture
def resources(kube: KubeStack, nats_server: EmbeddedNats) -> Resources:
    config = LapseConfig.model_validate(
        {
            "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
            "policies": [
                {"name": "nightly", "kubernetes": {"ttl": "7d"}, "keep_last": {"total": 1}}
            ],
        }
    )
    return Resources(config, nats_url=nats_server.url)


async def create(kube: KubeStack, ns: str, name: str, minutes_ago: int) -> dict[str, Any]:
    finished = NOW - timedelta(minutes=minutes_ago)
    body = argo_workflow(name, namespace=ns, finished_at=finished, labels={CRON: "etl"})
    return await kube.workflows.create(ns, body)


def finished_event(obj: dict[str, Any]) -> BaseCloudEvent:
    """The run event the watcher publishes for the object as it read it."""
    result = adapt_object(obj)
    assert isinstance(result, RunFinished)
    return build_event(EventType.RUN_FINISHED, source="/test", data=result)


async def test_a_finish_schedules_the_run_it_pushes_out(
    kube: KubeStack, lapse_streams: JetStreamContext, resources: Resources
) -> None:
    ns = kube.namespace(f"count-{uuid.uuid4().hex[:6]}")
    old = await create(kube, ns, "old", minutes_ago=20)
    new = await create(kube, ns, "new", minutes_ago=10)
    async with resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None
        produced = await planner.handle(finished_event(new), Trust.OBSERVED)
    scheduled = {
        s.run.name: s
        for e in produced
        if e.get_type() == EventType.CLEANUP_SCHEDULED
        and (s := parse_payload(e, CleanupScheduled)).target is Target.KUBERNETES
    }
    assert scheduled["new"].policy == "policy:nightly"
    assert scheduled["new"].deadline == NOW - timedelta(minutes=10) + timedelta(days=7)
    # Pushed out when "new" finished, and put now: that moment has passed.
    assert scheduled["old"].policy == "keep_last:nightly"
    assert scheduled["old"].deadline == NOW - timedelta(minutes=10)
    store = NatsScheduleStore(lapse_streams, resources.config.nats.streams)
    pending = await store.get(Target.KUBERNETES, old["metadata"]["uid"])
    assert pending is not None and pending.deadline == NOW - timedelta(minutes=10)
    # The version the planner listed: the reaper may DELETE held to it.
    assert scheduled["old"].run.resource_version == old["metadata"]["resourceVersion"]


async def test_a_run_already_counted_out_and_deleted_keeps_no_deadline(
    kube: KubeStack, lapse_streams: JetStreamContext, resources: Resources
) -> None:
    ns = kube.namespace(f"count-{uuid.uuid4().hex[:6]}")
    gone = await create(kube, ns, "gone", minutes_ago=20)
    event = finished_event(gone)
    async with resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None
        first = await planner.handle(event, Trust.OBSERVED)
        assert EventType.CLEANUP_SCHEDULED in {e.get_type() for e in first}
        await kube.workflows.delete(ns, "gone", uid=gone["metadata"]["uid"])
        # Its finish planned late (after another process's count deleted it): the group
        # list and a GET say it is gone, so its pending deadline is withdrawn, not kept.
        again = await planner.handle(event, Trust.OBSERVED)
    cancelled = [
        parse_payload(e, CleanupCancelled)
        for e in again
        if e.get_type() == EventType.CLEANUP_CANCELLED
    ]
    assert [(c.target, c.run.name) for c in cancelled] == [(Target.KUBERNETES, "gone")]
    store = NatsScheduleStore(lapse_streams, resources.config.nats.streams)
    assert await store.get(Target.KUBERNETES, gone["metadata"]["uid"]) is None


# --- grouped by a field: the namespace listed, the group read from each object ------------

TEMPLATE = "spec.workflowTemplateRef.name"


@pytest.fixture
def by_template(kube: KubeStack, nats_server: EmbeddedNats) -> Resources:
    config = LapseConfig.model_validate(
        {
            "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
            "policies": [
                {
                    "name": "templates",
                    "kubernetes": {"ttl": "7d"},
                    "keep_last": {"group_by": f"field:{TEMPLATE}", "total": 1},
                }
            ],
        }
    )
    return Resources(config, nats_url=nats_server.url)


async def submitted(
    kube: KubeStack, ns: str, name: str, template: str, minutes_ago: int
) -> dict[str, Any]:
    """A finished Workflow submitted from a WorkflowTemplate (Argo sets the reference in
    its spec; no label needed)."""
    body = argo_workflow(name, namespace=ns, finished_at=NOW - timedelta(minutes=minutes_ago))
    body["spec"]["workflowTemplateRef"] = {"name": template}
    return await kube.workflows.create(ns, body)


def kubernetes_events(events: list[BaseCloudEvent], kind: type[Any]) -> dict[str, Any]:
    found = {}
    for event in events:
        if event.get_type() not in (EventType.CLEANUP_SCHEDULED, EventType.CLEANUP_COMPLETED):
            continue
        jsonschema.validate(event.get_data(), load_schema(event.get_type()))
        payload = parse_payload(event)
        if isinstance(payload, kind) and payload.target is Target.KUBERNETES:
            found[payload.run.name] = payload
    return found


async def test_a_field_group_is_counted_from_its_namespace_and_recounted_by_the_reaper(
    kube: KubeStack, lapse_streams: JetStreamContext, by_template: Resources
) -> None:
    ns = kube.namespace(f"field-{uuid.uuid4().hex[:6]}")
    elsewhere = kube.namespace(f"field-{uuid.uuid4().hex[:6]}")
    old = await submitted(kube, ns, "etl-old", "etl", minutes_ago=30)
    report = await submitted(kube, ns, "report-old", "report", minutes_ago=40)
    await submitted(kube, elsewhere, "etl-elsewhere", "etl", minutes_ago=50)
    new = await submitted(kube, ns, "etl-new", "etl", minutes_ago=10)
    async with by_template:
        planner = await build_handler("ttl-planner", by_template)
        reaper = await build_handler("object-reaper", by_template)
        assert planner is not None and reaper is not None
        produced = await planner.handle(finished_event(new), Trust.OBSERVED)
        scheduled = kubernetes_events(produced, CleanupScheduled)
        # The older run of the same template is pushed out when the newer one finished;
        # another template's older run, and the same template in another namespace, are not
        # in its group.
        assert set(scheduled) == {"etl-new", "etl-old"}
        assert scheduled["etl-old"].policy == "keep_last:templates"
        assert scheduled["etl-old"].deadline == NOW - timedelta(minutes=10)
        assert scheduled["etl-old"].run.resource_version == old["metadata"]["resourceVersion"]

        # The reaper lists the namespace again before it deletes, and counts the same way.
        due = due_for(old, NOW - timedelta(minutes=10), policy="keep_last:templates")
        reaped = await reaper.handle(build_event(EventType.CLEANUP_DUE, source="/t", data=due))
        done = kubernetes_events(reaped, CleanupCompleted)
        assert done["etl-old"].outcome is Outcome.DELETED, done
        assert await kube.workflows.get(ns, "etl-old") is None
        # The report template's only run is its last one: counted, not deleted (its 7d TTL
        # stands).
        due = due_for(report, NOW - timedelta(minutes=10), policy="keep_last:templates")
        kept = await reaper.handle(build_event(EventType.CLEANUP_DUE, source="/t", data=due))
        assert kubernetes_events(kept, CleanupCompleted)["report-old"].outcome is (
            Outcome.RESCHEDULED
        )
        assert await kube.workflows.get(ns, "report-old") is not None
        assert await kube.workflows.get(elsewhere, "etl-elsewhere") is not None
