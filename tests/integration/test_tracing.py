"""Trace context and metrics on each hop, against a real NATS server.

- the dispatcher: a due event arrives in a new trace linked to where it was scheduled,
  every try is its own span, retries and a give-up are counted;
- the func-python shell: a SERVER span continues the Broker's `traceparent`, and the
  schedule it puts carries both the hop context and the event's own;
- configured by the standard OTEL_* environment, a function's spans and metrics reach an
  OTLP endpoint by the time `stop()` returns (scale to zero loses none), and `lapse serve`
  also serves the documented names on its Prometheus scrape endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import to_binary_event
from func_python.cloudevent import ASGIApplication
from nats.js import JetStreamContext
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind

from lapse import telemetry
from lapse.config import NatsConfig, Streams
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed, RunFinished
from lapse.events.nats_binding import from_nats, hop_trace_context
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import dlq_subject, schedule_subject
from lapse.events.types import EventType, Outcome
from lapse.functions import tracing
from lapse.functions.ports import RetryLater
from lapse.functions.trust import Provenance, Trust
from lapse.functions.ttl_planner.function import new
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.outages import Backoff
from lapse.runtime.routing import Route
from lapse.telemetry import names
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow

STREAMS = Streams()
DUE_ROUTE = Route(
    name="tracing-due",
    function="object-reaper",
    filters={"type": EventType.CLEANUP_DUE.value, "target": "kubernetes"},
)


@pytest.fixture
def js(lapse_streams: JetStreamContext) -> JetStreamContext:
    return lapse_streams


@pytest.fixture
def memory() -> Iterator[telemetry.InMemoryTelemetry]:
    recorded = telemetry.install_in_memory()
    yield recorded
    recorded.handle.shutdown()
    telemetry.reset()


def run_ref(**changes: Any) -> RunRef:
    fields: dict[str, Any] = {
        "engine": Engine.ARGO, "api_version": "argoproj.io/v1alpha1", "kind": "Workflow",
        "namespace": "team-t", "name": "wf-" + uuid.uuid4().hex[:6], "uid": str(uuid.uuid4()),
        "phase": "Succeeded", "finished_at": datetime.now(UTC),
    }  # fmt: skip
    return RunRef(**{**fields, **changes})


async def read_run(kube: KubeStack, annotations: dict[str, str]) -> RunRef:
    """A finished Workflow on the API server, and its run: an event over HTTP is a claim the
    planner checks there before planning it."""
    ns = kube.namespace("tracing")
    name = "wf-" + uuid.uuid4().hex[:6]
    finished = datetime.now(UTC).replace(microsecond=0)
    body = argo_workflow(name, namespace=ns, finished_at=finished)
    body["metadata"]["annotations"] = annotations
    wf = await kube.workflows.create(ns, body)
    return run_ref(
        namespace=ns, name=name, uid=wf["metadata"]["uid"], finished_at=finished,
        annotations=annotations,
    )  # fmt: skip


def counter(recorded: telemetry.InMemoryTelemetry, name: str, **wanted: str) -> float:
    data = recorded.reader.get_metrics_data()
    total = 0.0
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if all(attributes.get(k) == v for k, v in wanted.items()):
                        total += point.value
    return total


class Reaper:
    """Stands in for the object reaper's logic (tested against the API server
    elsewhere): fails `failures` times - transiently (503), or with a bug - then reports
    the deletion."""

    def __init__(self, failures: int, *, bug: bool = False) -> None:
        self.failures = failures
        self.bug = bug
        self.calls = 0

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        self.calls += 1
        if self.calls <= self.failures:
            if self.bug:
                raise RuntimeError("a bug in the handler")
            raise RetryLater("API server answered 503", delay=0.05)
        due = parse_payload(event, CleanupDue)
        done = CleanupCompleted.of(
            run=due.run, target=due.target, outcome=Outcome.DELETED,
            completed_at=datetime.now(UTC), deadline=due.deadline,
        )  # fmt: skip
        return [build_event(EventType.CLEANUP_COMPLETED, source="/test", data=done)]


async def schedule_due(js: JetStreamContext, run: RunRef, in_seconds: float) -> Any:
    """Put a due event the way the planner does: inside its decision span."""
    deadline = datetime.now(UTC) + timedelta(seconds=in_seconds)
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=deadline, policy="p",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    with telemetry.tracer().start_as_current_span("schedule kubernetes") as decision:
        event = build_event(
            EventType.CLEANUP_DUE, source="/test", data=due, **tracing.creation_context()
        )
        await NatsScheduleStore(js, STREAMS).put(
            Target.KUBERNETES, run.uid, deadline, event, provenance=Provenance.CLAIMED
        )
    return decision.get_span_context()


async def dispatch_until(
    js: JetStreamContext, handler: Any, done: Any, *, max_deliver: int = 5
) -> None:
    dispatcher = Dispatcher(
        js,
        NatsEmitter(js, STREAMS),
        NatsConfig(max_deliver=max_deliver),
        [Subscription(DUE_ROUTE, telemetry.InstrumentedHandler("object-reaper", handler))],
        backoff=Backoff(first=0.05, cap=0.2),
    )
    task = asyncio.create_task(dispatcher.run())
    try:
        await wait_for(done, timeout=30, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(task, 10)


def process_spans(recorded: telemetry.InMemoryTelemetry, uid: str) -> list[Any]:
    return sorted(
        (
            span
            for span in recorded.spans()
            if span.kind is SpanKind.CONSUMER
            and dict(span.attributes or {}).get(names.MESSAGING_DESTINATION)
            == f"lapse.due.kubernetes.{uid}"
        ),
        key=lambda span: dict(span.attributes or {})[names.DELIVERY_ATTEMPT],
    )


async def test_each_try_of_a_due_event_is_a_new_trace_linked_to_its_schedule(
    js: JetStreamContext, memory: telemetry.InMemoryTelemetry
) -> None:
    run = run_ref()
    decision = await schedule_due(js, run, in_seconds=0.5)
    reaper = Reaper(failures=1)

    async def deleted() -> bool:
        return counter(memory, names.DELETIONS.name, **{names.OUTCOME: "deleted"}) == 1

    await dispatch_until(js, reaper, deleted)

    first, second = process_spans(memory, run.uid)
    for span in (first, second):
        assert span.name == "process lapse.due.kubernetes.*"
        assert span.parent is None  # a new trace, not a child of a days-old decision
        assert span.context is not None and span.context.trace_id != decision.trace_id
        kinds = {
            (link.attributes or {})[names.LINK_KIND]: link.context.span_id for link in span.links
        }
        assert kinds["creation"] == decision.span_id
        hop = next(s for s in memory.spans() if s.name == "send lapse.sched.kubernetes.*")
        assert hop.context is not None and kinds["hop"] == hop.context.span_id
        assert dict(span.attributes or {})[names.MESSAGING_SUBSCRIPTION] == "lapse-tracing-due"
    assert [event.name for event in first.events] == ["nak"]
    assert second.events == ()
    assert counter(memory, names.RETRIES.name, **{names.FUNCTION: "object-reaper"}) == 1
    assert counter(memory, names.DELETIONS.name) == 1  # the try that failed is no outcome


async def test_a_transient_failure_is_waited_out_never_dead_lettered(
    js: JetStreamContext, memory: telemetry.InMemoryTelemetry
) -> None:
    run = run_ref()
    await schedule_due(js, run, in_seconds=0.2)
    reaper = Reaper(failures=8)  # far more tries than max_deliver allows a bug

    async def deleted() -> bool:
        return counter(memory, names.DELETIONS.name, **{names.OUTCOME: "deleted"}) == 1

    await dispatch_until(js, reaper, deleted, max_deliver=3)

    assert reaper.calls == 9
    assert counter(memory, names.RETRIES.name, **{names.ERROR_TYPE: "RetryLater"}) == 8
    assert counter(memory, names.DELETIONS.name, **{names.OUTCOME: "failed"}) == 0
    assert (await js.stream_info(STREAMS.dlq)).state.messages == 0


async def test_giving_up_is_a_failed_deletion_and_the_dead_letter_names_its_span(
    js: JetStreamContext, memory: telemetry.InMemoryTelemetry
) -> None:
    run = run_ref()
    await schedule_due(js, run, in_seconds=0.2)
    reaper = Reaper(failures=99, bug=True)

    async def given_up() -> bool:
        return counter(memory, names.DELETIONS.name, **{names.OUTCOME: "failed"}) == 1

    await dispatch_until(js, reaper, given_up, max_deliver=3)

    assert reaper.calls == 3
    tries = process_spans(memory, run.uid)
    assert [[event.name for event in span.events] for span in tries] == [
        ["nak"], ["nak"], ["dead-lettered"],
    ]  # fmt: skip
    assert counter(memory, names.RETRIES.name, **{names.ERROR_TYPE: "RuntimeError"}) == 2
    message = await js.get_last_msg(STREAMS.dlq, dlq_subject(EventType.CLEANUP_FAILED))
    dead = from_nats(message.headers, message.data)
    assert parse_payload(dead, CleanupFailed).run == run
    span_id = dead.get_extension("traceparent").split("-")[2]
    assert tries[-1].context is not None and span_id == f"{tries[-1].context.span_id:016x}"


async def test_the_function_shell_continues_the_brokers_trace(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    memory: telemetry.InMemoryTelemetry,
    kube: KubeStack,
) -> None:
    function = new()
    function.start(
        {"LAPSE_NATS__URL": nats_server.url, "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)}
    )
    await function.started()
    broker_trace = uuid.uuid4().hex
    broker = f"00-{broker_trace}-{uuid.uuid4().hex[:16]}-01"
    run = await read_run(kube, {"lapse.dev/ttl": "1h"})
    message = to_binary_event(
        build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
    )
    transport = httpx.ASGITransport(app=ASGIApplication(function))
    async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:
        response = await http.post(
            "/", headers={**message.headers, "traceparent": broker}, content=message.body
        )
    assert response.status_code == 202
    function.stop()

    spans = memory.spans()
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /"
    assert server.parent is not None and f"{server.parent.span_id:016x}" == broker[36:52]
    assert server.context is not None and f"{server.context.trace_id:032x}" == broker_trace
    assert dict(server.attributes or {})[names.HTTP_STATUS] == 202
    assert dict(server.attributes or {})[names.CE_TYPE] == EventType.RUN_FINISHED
    (planner,) = [s for s in spans if s.name == "ttl-planner"]
    assert planner.parent is not None and planner.parent.span_id == server.context.span_id
    (decision,) = [s for s in spans if s.name == "schedule kubernetes"]
    (put,) = [s for s in spans if s.name == "send lapse.sched.kubernetes.*"]
    assert decision.context is not None and put.context is not None

    stored = await js.get_last_msg(STREAMS.schedule, schedule_subject(Target.KUBERNETES, run.uid))
    hop, _ = hop_trace_context(stored.headers)
    assert hop is not None and hop.split("-")[2] == f"{put.context.span_id:016x}"
    creation = from_nats(stored.headers, stored.data).get_extension("traceparent")
    assert creation.split("-")[1:3] == [
        f"{decision.context.trace_id:032x}",
        f"{decision.context.span_id:016x}",
    ]


class Collector(ThreadingHTTPServer):
    """Receives OTLP/HTTP exports like a Collector's otlp receiver on :4318 would."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        super().__init__(("127.0.0.1", 0), _Receive)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self) -> list[tuple[str, str]]:
        found = []
        for path, body in self.requests:
            if path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource.resource.attributes
                        if a.key == "service.name"
                    )
                    found += [
                        (service, s.name) for scope in resource.scope_spans for s in scope.spans
                    ]
        return found

    def metric_names(self) -> set[str]:
        return {
            metric.name
            for path, body in self.requests
            if path == "/v1/metrics"
            for resource in ExportMetricsServiceRequest.FromString(body).resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }


class _Receive(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert isinstance(self.server, Collector)
        self.server.requests.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


FLUSH_ON_STOP = """
import asyncio, json, os, sys
import httpx
from func_python.cloudevent import ASGIApplication
from lapse.functions.ttl_planner.function import new

async def main() -> None:
    request = json.loads(sys.stdin.read())
    function = new()
    function.start(dict(os.environ))
    await function.started()
    transport = httpx.ASGITransport(app=ASGIApplication(function))
    async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:
        response = await http.post("/", headers=request["headers"], content=request["body"])
    print(response.status_code, flush=True)
    function.stop()

asyncio.run(main())
os._exit(0)  # no atexit hooks: what was not exported by stop() is lost
"""


async def test_stop_exports_what_the_function_recorded(
    nats_server: EmbeddedNats, js: JetStreamContext, kube: KubeStack
) -> None:
    collector = Collector()
    run = await read_run(kube, {"lapse.dev/ttl": "2h"})
    message = to_binary_event(
        build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
    )
    request = json.dumps({"headers": dict(message.headers), "body": message.body.decode()})
    env = {
        **os.environ,
        "LAPSE_NATS__URL": nats_server.url,
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "600000",  # nothing goes out on a timer
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
    }
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", FLUSH_ON_STOP],
            input=request, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        collector.shutdown()
    assert result.returncode == 0 and result.stdout.strip() == "202", result.stderr[-3000:]
    assert {name for _, name in collector.spans()} >= {"POST /", "ttl-planner"}
    assert names.HANDLER_DURATION.name in collector.metric_names()


async def test_lapse_serve_exports_on_stop_and_serves_prometheus(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path, kube: KubeStack
) -> None:
    collector = Collector()
    port, scrape = free_port(), free_port()
    run = await read_run(kube, {"lapse.dev/ttl": "2h"})
    env = {
        **os.environ,
        "LAPSE_NATS__URL": nats_server.url,
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        # Nothing is exported on a timer within this test: only the shutdown can deliver.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        "LAPSE_PROMETHEUS_PORT": str(scrape),
        "LAPSE_PROMETHEUS_HOST": "127.0.0.1",
    }
    with (tmp_path / "serve.log").open("wb") as log:
        # Popen returns at once; the waits below are bounded polls.
        server = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "lapse.cli", "serve", "ttl-planner",
             "--listen", f"127.0.0.1:{port}"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient() as http:

            async def ready() -> bool:
                try:
                    url = f"http://127.0.0.1:{port}/health/readiness"
                    return (await http.get(url)).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, timeout=30, interval=0.2)
            message = to_binary_event(
                build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
            )
            url = f"http://127.0.0.1:{port}/"
            response = await http.post(url, headers=message.headers, content=message.body)
            assert response.status_code == 202, response.text
            metrics = (await http.get(f"http://127.0.0.1:{scrape}/metrics")).text
        assert collector.requests == []  # nothing sent yet: batching until stop
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        collector.shutdown()
    log_text = (tmp_path / "serve.log").read_text()
    assert server.returncode == 0, log_text[-3000:]

    duration = [
        line
        for line in metrics.splitlines()
        if line.startswith("lapse_handler_duration_seconds_count{")
        and 'lapse_function="ttl-planner"' in line
    ]
    assert len(duration) == 1 and duration[0].endswith(" 1.0"), metrics
    assert "lapse_schedule_changes_total{" in metrics
    spans = collector.spans()
    assert {name for _, name in spans} >= {
        "POST /",
        "ttl-planner",
        "schedule kubernetes",
        "send lapse.sched.kubernetes.*",
    }, log_text[-3000:]
    assert {service for service, _ in spans} == {"lapse-ttl-planner"}
    assert {names.HANDLER_DURATION.name, names.SCHEDULE_CHANGES.name} <= collector.metric_names()
