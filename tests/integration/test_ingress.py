"""The HTTP ingress: pushed CloudEvents are stored in JetStream before the 202."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind

from lapse import telemetry
from lapse.config import Streams
from lapse.edges.publishing import NatsPublisher
from lapse.events.nats_binding import from_nats, hop_trace_context
from lapse.functions.trust import Provenance
from lapse.runtime.ingress import Ingress

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
    app = Ingress(NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED).publish)
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


async def test_ingress_continues_the_senders_trace(lapse_streams: JetStreamContext) -> None:
    recorded = telemetry.install_in_memory()
    try:
        sender_trace = uuid.uuid4().hex
        sender = f"00-{sender_trace}-{uuid.uuid4().hex[:16]}-01"
        app = Ingress(NatsPublisher(lapse_streams, STREAMS, provenance=Provenance.CLAIMED).publish)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://ingress"
        ) as http:
            headers = {**apiserver_update(WORKFLOW), "traceparent": sender}
            response = await http.post("/", headers=headers, content=json.dumps(WORKFLOW))
        assert response.status_code == 202
        (server,) = [s for s in recorded.spans() if s.kind is SpanKind.SERVER]
        assert server.context is not None and f"{server.context.trace_id:032x}" == sender_trace
        assert server.parent is not None and f"{server.parent.span_id:016x}" == sender[36:52]
    finally:
        recorded.handle.shutdown()
        telemetry.reset()
    stored = await lapse_streams.get_last_msg(STREAMS.events, "lapse.events.>")
    hop, _ = hop_trace_context(stored.headers)
    assert hop is not None and hop.split("-")[1] == sender_trace  # the hop is in that trace
