"""The HTTP ingress: pushed CloudEvents are stored in JetStream before the 202."""

from __future__ import annotations

import json
from typing import Any

import httpx
from nats.js import JetStreamContext

from events.nats_binding import from_nats
from lapse.bus import NatsPublisher
from lapse.config import Streams
from lapse.ingress import Ingress

STREAMS = Streams()


def apiserver_update(workflow: dict[str, Any]) -> dict[str, str]:
    """Headers of a Knative ApiServerSource event in Resource mode (binary content mode)."""
    return {
        "ce-specversion": "1.0",
        "ce-id": "6f0e9a1e-1",
        "ce-source": "https://10.96.0.1:443",
        "ce-type": "dev.knative.apiserver.resource.update",
        "ce-subject": "/apis/argoproj.io/v1alpha1/namespaces/ns/workflows/"
        + workflow["metadata"]["name"],
        "content-type": "application/json",
    }


WORKFLOW = {
    "apiVersion": "argoproj.io/v1alpha1",
    "kind": "Workflow",
    "metadata": {
        "name": "pushed",
        "namespace": "ns",
        "uid": "a3c1a0a4-6b7e-4d0e-9f55-8f1f0f6f3c01",
        "resourceVersion": "42",
        "labels": {"workflows.argoproj.io/completed": "true"},
    },
    "spec": {"entrypoint": "main"},
    "status": {"phase": "Succeeded", "finishedAt": "2026-11-21T10:00:00Z"},
}


async def test_pushed_events_are_stored_or_refused_with_a_reason(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    app = Ingress(NatsPublisher(js, STREAMS).publish)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://ingress"
    ) as http:
        ok = await http.post("/", headers=apiserver_update(WORKFLOW), content=json.dumps(WORKFLOW))
        assert ok.status_code == 202, ok.text

        broken = {**WORKFLOW, "metadata": {"name": "no-uid", "namespace": "ns"}}
        refused = await http.post("/", headers=apiserver_update(broken), content=json.dumps(broken))
        assert refused.status_code == 400
        assert "uid" in refused.text

        running = {**WORKFLOW, "status": {"phase": "Running"}}
        quiet = await http.post("/", headers=apiserver_update(running), content=json.dumps(running))
        assert quiet.status_code == 202
        assert quiet.text.startswith("ignored")

        garbage = await http.post("/", content=b"not an event")
        assert garbage.status_code == 400

    stored = await js.pull_subscribe("lapse.events.>", durable="check", stream=STREAMS.events)
    msgs = await stored.fetch(10, timeout=2)
    assert len(msgs) == 1  # only the usable one
    event = from_nats(msgs[0].headers, msgs[0].data)
    assert event.get_type() == "dev.knative.apiserver.resource.update"
    assert event.get_data()["metadata"]["uid"] == WORKFLOW["metadata"]["uid"]  # type: ignore[index]
