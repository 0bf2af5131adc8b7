"""A lapse function served the way Knative serves it: func-python's ASGI app, HTTP in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from cloudevents.core.bindings.http import to_binary_event
from cloudevents.core.v1.event import CloudEvent
from func_python.cloudevent import ASGIApplication
from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupDue, CleanupFailed, RunFinished
from lapse.events.observed import OBSERVED_HEADER
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import schedule_subject
from lapse.events.types import EventType
from lapse.functions.row_reaper.function import new as new_row_reaper
from lapse.functions.ttl_planner.function import new
from lapse.operations.audit import audit_events
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow


async def test_planner_function_schedules_from_an_http_cloudevent(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    """A run.finished over HTTP is a claim: the planner plans the Workflow as it reads it
    from the API server (its real finishedAt), never the finish time the event states, and
    the schedule says lapse read that version itself."""
    ns = kube.namespace("shell-planner")
    finished = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    body = argo_workflow("wf", namespace=ns, finished_at=finished)
    body["metadata"]["annotations"] = {"lapse.dev/ttl": "30d"}
    wf = await kube.workflows.create(ns, body)
    uid = wf["metadata"]["uid"]
    function = new()
    function.start(
        {"LAPSE_NATS__URL": nats_server.url, "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)}
    )
    await function.started()
    app = ASGIApplication(function)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:
        assert (await http.get("/health/readiness")).status_code == 200

        # The claim: finished in 2000, so due long ago.
        run = claimed_run(ns, "wf", uid, finished_at=datetime(2000, 1, 1, tzinfo=UTC))
        message = to_binary_event(
            build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
        )
        response = await http.post("/", headers=message.headers, content=message.body)
        assert response.status_code == 202

        not_an_event = await http.post("/", content=b"hello")
        assert not_an_event.status_code == 400

    nc = await connect(nats_server.url)
    pending = await NatsScheduleStore(nc.jetstream(), Streams()).get(Target.KUBERNETES, uid)
    await nc.close()
    assert pending is not None
    assert pending.deadline == finished + timedelta(days=30)
    stored = await lapse_streams.get_last_msg(
        Streams().schedule, schedule_subject(Target.KUBERNETES, uid)
    )
    assert stored.headers is not None and stored.headers.get(OBSERVED_HEADER) == "apiserver"
    function.stop()


async def test_an_event_over_http_is_never_taken_as_read_by_lapse(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    """A run.finished posted with the observed attribute for an object the API server does
    not have is a claim lapse cannot check: refused and recorded, nothing scheduled."""
    function = new()
    function.start(
        {"LAPSE_NATS__URL": nats_server.url, "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)}
    )
    await function.started()
    transport = httpx.ASGITransport(app=ASGIApplication(function))
    uid = str(uuid.uuid4())
    run = claimed_run(
        kube.namespace("shell-claim"), "claimed", uid, finished_at=datetime(2000, 1, 1, tzinfo=UTC)
    )
    event = build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
    attributes = {**event.get_attributes(), "lapseobserved": "apiserver"}
    message = to_binary_event(CloudEvent(attributes=attributes, data=event.get_data()))
    assert message.headers.get("ce-lapseobserved") == "apiserver"
    async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:
        response = await http.post("/", headers=message.headers, content=message.body)
        assert response.status_code == 202
    function.stop()
    [failed] = [
        parse_payload(e, CleanupFailed)
        async for e in audit_events(
            lapse_streams, Streams().audit, event_type=EventType.CLEANUP_FAILED
        )
    ]
    assert failed.stage == "planner" and failed.run is not None and failed.run.uid == uid
    assert failed.reason.startswith("refused: the API server has no Workflow")
    for target in (Target.KUBERNETES, Target.DATABASE):
        assert await NatsScheduleStore(lapse_streams, Streams()).get(target, uid) is None


def claimed_run(namespace: str, name: str, uid: str, *, finished_at: datetime) -> RunRef:
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=namespace, name=name, uid=uid, phase="Succeeded",
        finished_at=finished_at, annotations={"lapse.dev/ttl": "30d"},
    )  # fmt: skip


async def test_function_with_bad_config_is_not_ready() -> None:
    function = new()
    function.start({"LAPSE_SAFETY__DRY_RUN": "maybe"})
    await function.started()
    ready, why = function.ready()
    assert ready is False
    assert "LAPSE_SAFETY__DRY_RUN" in why
    app = ASGIApplication(function)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://f"
    ) as http:
        assert (await http.get("/health/readiness")).status_code == 500


async def test_a_function_with_nothing_to_do_is_ready_and_refuses_work(
    nats_server: EmbeddedNats,
) -> None:
    """The row-reaper without a database target: Ready (its Trigger resolves), and a due
    event routed to it anyway is answered 503, so the Broker keeps it (retries, then the
    dead-letter sink) instead of losing it."""
    function = new_row_reaper()
    function.start({"LAPSE_NATS__URL": nats_server.url})
    await function.started()
    ready, why = function.ready()
    assert ready is True and "idle" in why
    app = ASGIApplication(function)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://f"
    ) as http:
        assert (await http.get("/health/readiness")).status_code == 200
        run = RunRef(
            engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
            namespace="ns", name="wf", uid=str(uuid.uuid4()), phase="Succeeded",
        )  # fmt: skip
        due = CleanupDue(
            run=run, target=Target.DATABASE, deadline=datetime.now(UTC), policy="p",
            scheduled_at=datetime.now(UTC),
        )  # fmt: skip
        message = to_binary_event(build_event(EventType.CLEANUP_DUE, source="/test", data=due))
        answer = await http.post("/", headers=message.headers, content=message.body)
        assert answer.status_code == 503
        assert "nothing to do with this configuration" in answer.text
    function.stop()


async def test_lapse_serve_runs_a_function_over_http(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext, tmp_path: Path
) -> None:
    ns = kube.namespace("shell-serve")
    body = argo_workflow(
        "served",
        namespace=ns,
        phase="Failed",
        finished_at=datetime(2026, 11, 21, 12, 0, tzinfo=UTC),
    )
    body["metadata"]["annotations"] = {"lapse.dev/ttl": "1h"}
    uid = (await kube.workflows.create(ns, body))["metadata"]["uid"]
    port = free_port()
    env = {
        **os.environ,
        "LAPSE_NATS__URL": nats_server.url,
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
    }
    with (tmp_path / "serve.log").open("wb") as log:
        # Popen returns at once; the waits below are bounded polls.
        server = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "lapse.cli", "serve", "ttl-planner",
             "--listen", f"127.0.0.1:{port}"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/health/readiness")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, timeout=30, interval=0.2)
            run = RunRef(
                engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
                namespace=ns, name="served", uid=uid, phase="Failed",
                finished_at=datetime(2026, 11, 21, 12, 0, tzinfo=UTC),
                annotations={"lapse.dev/ttl": "1h"},
            )  # fmt: skip
            message = to_binary_event(
                build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
            )
            response = await http.post("/", headers=message.headers, content=message.body)
            assert response.status_code == 202, response.text
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    nc = await connect(nats_server.url)
    pending = await NatsScheduleStore(nc.jetstream(), Streams()).get(Target.KUBERNETES, uid)
    await nc.close()
    assert pending is not None and pending.deadline == datetime(2026, 11, 21, 13, 0, tzinfo=UTC)
