"""The due-event bridge against real NATS and a real HTTP sink (Hypercorn on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import hypercorn.asyncio
import hypercorn.config
import nats
import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_http_event
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind

from lapse import telemetry
from lapse.config import LapseConfig, Streams
from lapse.edges.schedules import schedule_headers
from lapse.edges.streams import ensure_streams, stream_configs
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed
from lapse.events.nats_binding import to_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import audit_subject, dlq_subject, due_subject, schedule_subject
from lapse.events.types import EventType, Outcome
from lapse.runtime.bridge import Bridge
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()


class Sink:
    """An HTTP sink that records what it receives; `answers` are used up first, then 202."""

    def __init__(self) -> None:
        self.port = free_port()
        self.answers: list[int] = []
        self.always: int | None = None
        self.delay = 0.0
        self.serial = False  # one request at a time, as a slow Broker would
        self._one = asyncio.Lock()
        self.received: list[tuple[dict[str, str], Any]] = []
        self.by_replica: Counter[str] = Counter()
        self.posts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with self._one if self.serial else contextlib.nullcontext():
            self.posts += 1
            if self.delay:
                await asyncio.sleep(self.delay)
            status = self.always or (self.answers.pop(0) if self.answers else 202)
        if status == 202:
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.received.append((headers, from_http_event(HTTPMessage(headers, body))))
            self.by_replica[scope["query_string"].decode()] += 1
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def uids(self) -> Counter[str]:
        return Counter(parse_payload(event, CleanupDue).run.uid for _, event in self.received)


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    app = Sink()
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{app.port}"]
    config.accesslog = None
    stop = asyncio.Event()
    serving = asyncio.create_task(hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    yield app
    stop.set()
    await serving


def due_event(uid: str | None = None) -> Any:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"wf-{uuid.uuid4().hex[:6]}", uid=uid or str(uuid.uuid4()),
        phase="Succeeded", finished_at=datetime.now(UTC),
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=datetime.now(UTC), policy="p",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    return build_event(EventType.CLEANUP_DUE, source="/test", data=due)


async def fire(js: JetStreamContext, count: int) -> list[str]:
    """Due events as the NATS scheduler stores them when schedules fire."""
    uids = []
    for _ in range(count):
        event = due_event()
        uid = parse_payload(event, CleanupDue).run.uid
        message = to_nats(event)
        await js.publish(due_subject(Target.KUBERNETES, uid), message.body, headers=message.headers)
        uids.append(uid)
    return uids


@contextlib.asynccontextmanager
async def bridge(
    nats_url: str, sink: Sink, replica: str = "", **nats: Any
) -> AsyncIterator[Bridge]:
    config = LapseConfig.model_validate({"nats": {"url": nats_url, **nats}})
    running = Bridge(config, f"{sink.url}?{replica}", listen=None)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    await wait_for(lambda: asyncio.sleep(0, running.ready.is_set()), timeout=30)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def settled(js: JetStreamContext) -> bool:
    info = await js.consumer_info(STREAMS.schedule, "lapse-bridge-due")
    return not info.num_pending and not info.num_ack_pending


async def test_delivered_after_a_2xx_and_retried_after_5xx_never_dead_lettered(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    sink.answers = [503, 503, 500]
    async with bridge(nats_server.url, sink):
        (uid,) = await fire(lapse_streams, 1)
        await wait_for(lambda: settled(lapse_streams), timeout=60, interval=0.2)
    assert sink.posts == 4
    assert sink.uids() == Counter({uid: 1})
    headers, event = sink.received[0]
    assert headers["ce-type"] == EventType.CLEANUP_DUE  # binary content mode
    assert event.get_type() == EventType.CLEANUP_DUE
    assert (await lapse_streams.stream_info(STREAMS.dlq)).state.messages == 0


async def test_a_refusal_is_dead_lettered_with_the_sinks_answer(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    sink.always = 400
    async with bridge(nats_server.url, sink, max_deliver=2):
        (uid,) = await fire(lapse_streams, 1)
        await wait_for(lambda: settled(lapse_streams), timeout=60, interval=0.2)
    message = await lapse_streams.get_last_msg(STREAMS.dlq, dlq_subject(EventType.CLEANUP_FAILED))
    from lapse.events.nats_binding import from_nats

    failed = parse_payload(from_nats(message.headers, message.data), CleanupFailed)
    assert failed.run is not None and failed.run.uid == uid
    assert "HTTP 400" in failed.reason and failed.stage == "bridge"


async def test_the_post_continues_the_deliverys_trace(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    memory = telemetry.install_in_memory()
    try:
        async with bridge(nats_server.url, sink):
            await fire(lapse_streams, 1)
            await wait_for(lambda: settled(lapse_streams), timeout=60, interval=0.2)
        (consumer,) = [s for s in memory.spans() if s.kind is SpanKind.CONSUMER]
    finally:
        telemetry.reset()
    headers, _ = sink.received[0]
    trace_id, span_id = headers["traceparent"].split("-")[1:3]
    assert consumer.context is not None
    assert trace_id == f"{consumer.context.trace_id:032x}"
    assert span_id == f"{consumer.context.span_id:016x}"


async def test_replicas_share_the_work(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    async with bridge(nats_server.url, sink, "one"), bridge(nats_server.url, sink, "two"):
        uids = []
        for _ in range(20):  # in waves, each taken by whichever replica asks first
            uids += await fire(lapse_streams, 3)
            await asyncio.sleep(0.2)
        await wait_for(lambda: settled(lapse_streams), timeout=120, interval=0.2)
    assert sink.uids() == Counter(dict.fromkeys(uids, 1)), "each delivered once"
    assert sink.by_replica["one"] > 0 and sink.by_replica["two"] > 0, sink.by_replica


async def test_a_killed_bridge_loses_nothing(
    tmp_path: Path, nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    sink.delay, sink.serial = 0.1, True  # 4 s of work, so the kill lands mid-way
    config = tmp_path / "lapse.yaml"
    config.write_text(f"nats: {{url: '{nats_server.url}'}}\n")
    args = [sys.executable, "-m", "lapse.cli", "--config", str(config), "bridge",
            "--sink", sink.url, "--listen", ""]  # fmt: skip
    log = (tmp_path / "bridge.log").open("ab")
    first = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    uids = await fire(lapse_streams, 40)
    await wait_for(lambda: asyncio.sleep(0, len(sink.received) >= 5), timeout=60)  # type: ignore[arg-type]
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    delivered_before = len(sink.received)
    second = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    try:
        await wait_for(lambda: settled(lapse_streams), timeout=120, interval=0.5)
    finally:
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0
    assert delivered_before < len(uids), "the kill must land mid-work"
    assert set(sink.uids()) == set(uids), "no due event is lost"
    duplicates = sum(n - 1 for n in sink.uids().values())
    print(f"\nbridge kill -9: {len(uids)} due, 0 lost, {duplicates} delivered twice")


def completed_event() -> Any:
    due = parse_payload(due_event(), CleanupDue)
    done = CleanupCompleted.of(
        run=due.run, target=Target.KUBERNETES, outcome=Outcome.DELETED,
        completed_at=datetime.now(UTC), deadline=due.deadline,
    )  # fmt: skip
    return build_event(EventType.CLEANUP_COMPLETED, source="/test", data=done)


async def test_outcomes_reach_the_sink_from_the_bridges_start_on(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, sink: Sink
) -> None:
    """cleanup.completed on the audit stream goes to the Broker too (extensions subscribe
    there); what the audit trail held before the bridge first ran is not replayed."""

    async def publish() -> str:
        event = completed_event()
        message = to_nats(event)
        subject = audit_subject(EventType.CLEANUP_COMPLETED)
        await lapse_streams.publish(subject, message.body, headers=message.headers)
        return str(event.get_id())

    history = await publish()
    async with bridge(nats_server.url, sink):
        new = await publish()

        async def delivered() -> bool:
            return any(event.get_id() == new for _, event in sink.received)

        await wait_for(delivered, timeout=30, interval=0.1)
        await asyncio.sleep(1)  # time enough to deliver the old one too, were it taken
    ids = [event.get_id() for _, event in sink.received]
    assert ids == [new], (history, ids)
    headers, event = sink.received[0]
    assert headers["ce-type"] == EventType.CLEANUP_COMPLETED
    assert parse_payload(event, CleanupCompleted).outcome == Outcome.DELETED


async def schedule(js: JetStreamContext, deadline: datetime) -> str:
    """A due event parked until `deadline`, as the ttl-planner parks one (the server fires
    it onto lapse.due.kubernetes.<uid>)."""
    event = due_event()
    uid = parse_payload(event, CleanupDue).run.uid
    message = to_nats(event)
    headers = {**message.headers, **schedule_headers(deadline, due_subject(Target.KUBERNETES, uid))}
    headers.pop("Nats-Msg-Id", None)
    await js.publish(schedule_subject(Target.KUBERNETES, uid), message.body, headers=headers)
    return uid


async def test_the_bridge_waits_out_nats_and_its_streams_and_delivers_what_fell_due(
    own_nats: EmbeddedNats, sink: Sink
) -> None:
    """The bridge's tasks run under the Supervisor, as `lapse up`'s do. Started before its
    streams exist (the Deployment up before `lapse up` or the install made them), it once
    ended at once ("stream not found": a CrashLoopBackOff); it now waits, says why, and
    delivers once they exist. Then NATS stops and starts again on the same port and store:
    nothing ends, and the schedules that fell due while it was away are delivered."""
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    js = nc.jetstream()
    config = LapseConfig.model_validate({"nats": {"url": own_nats.url}})
    running = Bridge(config, sink.url, listen=None)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))

    def alive() -> None:
        assert not task.done(), task.exception() if not task.cancelled() else "cancelled"

    async def waiting_for_streams() -> bool:
        alive()
        supervisor = getattr(running, "supervisor", None)  # None: not started yet
        waits = supervisor.waiting() if supervisor is not None else {}
        return any("NATS stream not found" in w.reason for w in waits.values())

    try:
        await wait_for(waiting_for_streams, timeout=20, interval=0.2)
        await ensure_streams(js, stream_configs(STREAMS))
        before = await fire(js, 2)

        async def delivered(uids: set[str]) -> bool:
            alive()
            return set(sink.uids()) == uids

        await wait_for(lambda: delivered(set(before)), timeout=30, interval=0.2)
        # Due while NATS is away: fired by its scheduler when it is back.
        deadline = datetime.now(UTC) + timedelta(seconds=2)
        meanwhile = [await schedule(js, deadline) for _ in range(3)]
        own_nats.stop()
        down = time.monotonic()
        while time.monotonic() - down < 8:
            alive()
            await asyncio.sleep(0.5)
        await asyncio.to_thread(own_nats.start, healthy=True)
        back = time.monotonic()
        await wait_for(lambda: delivered({*before, *meanwhile}), timeout=40, interval=0.3)
        print(f"\nbridge: NATS away 8s, 3 due in it delivered {time.monotonic() - back:.1f}s after")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()
    assert all(n == 1 for n in sink.uids().values()), sink.uids()
