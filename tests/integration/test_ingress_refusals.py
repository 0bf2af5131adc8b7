"""The ingress refuses what a sender got wrong with a 4xx and leaves a record an operator
can read (`lapse dlq list --stage ingress`): against the real NATS server, over real HTTP
where the size of a body matters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import hypercorn.asyncio
import hypercorn.config
import pytest
import yaml
from nats.js import JetStreamContext

from lapse import telemetry
from lapse.config import ConfigError, LapseConfig, Streams
from lapse.edges.nats import max_payload
from lapse.edges.publishing import NatsEmitter, NatsPublisher
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port, port_open
from lapse.functions.trust import Provenance
from lapse.operations.dlq import DeadLetter, Filter, dead_letters
from lapse.runtime.ingress import Ingress, nats_ingress
from lapse.telemetry.names import INGRESS_RECORDED, INGRESS_REJECTION, INGRESS_REJECTIONS
from tests.integration.test_ingress import WORKFLOW, apiserver_update
from tests.integration.test_tracing import counter
from tests.stack import wait_for

pytestmark = [pytest.mark.nats]

STREAMS = Streams()


def structured(size: int) -> bytes:
    """A structured-mode CloudEvent whose JSON is `size` bytes long."""
    event: dict[str, Any] = {
        "specversion": "1.0",
        "id": "big-1",
        "source": "/sender",
        "type": "dev.knative.apiserver.resource.update",
        "datacontenttype": "application/json",
        "data": {**WORKFLOW, "padding": ""},
    }
    base = len(json.dumps(event).encode())
    event["data"]["padding"] = "x" * (size - base)
    body = json.dumps(event).encode()
    assert len(body) == size
    return body


STRUCTURED = {"content-type": "application/cloudevents+json"}


@contextlib.asynccontextmanager
async def served(app: Ingress) -> AsyncIterator[str]:
    """The ingress on a loopback port, served by hypercorn as `lapse up` serves it."""
    port = free_port()
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    stop = asyncio.Event()
    task = asyncio.create_task(
        hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    )

    async def listening() -> bool:
        return port_open(port)

    await wait_for(listening, timeout=10, interval=0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await app.flush()


async def recorded(js: JetStreamContext, count: int) -> list[DeadLetter]:
    async def enough() -> bool:
        letters = [x async for x in dead_letters(js, STREAMS.dlq, Filter(stage="ingress"))]
        return len(letters) >= count

    await wait_for(enough, timeout=10, interval=0.1)
    return [x async for x in dead_letters(js, STREAMS.dlq, Filter(stage="ingress"))]


async def stored_events(js: JetStreamContext) -> int:
    return (await js.stream_info(STREAMS.events)).state.messages


async def test_a_1_mb_event_is_413_and_recorded(lapse_streams: JetStreamContext) -> None:
    js = lapse_streams
    memory = telemetry.install_in_memory()
    try:
        app = await nats_ingress(js, LapseConfig())
        async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            response = await http.post("/", headers=STRUCTURED, content=structured(1_000_000))
            assert response.status_code == 413, response.text
            assert "ingress.max_body_bytes" in response.text
            # The connection is still good for the next event: the body was read, not cut.
            ok = await http.post(
                "/", headers=apiserver_update(WORKFLOW), content=json.dumps(WORKFLOW)
            )
            assert ok.status_code == 202, ok.text
        assert counter(memory, INGRESS_REJECTIONS.name, **{INGRESS_REJECTION: "too_large"}) == 1
    finally:
        memory.handle.shutdown()
        telemetry.reset()
    [letter] = await recorded(js, 1)
    assert letter.failed is not None and letter.failed.reason.startswith("413: body larger")
    original = letter.failed.original
    assert original is not None and original.truncated
    assert original.data is not None and original.data.startswith('{"specversion"')
    assert await stored_events(js) == 1  # only the good one


async def test_what_nats_refuses_for_size_is_413_not_503(
    lapse_streams: JetStreamContext,
) -> None:
    """The issue's case: a limit above what the server takes (or a limit that leaves no room
    for the headers). NATS refuses the message; the sender must not be told to retry."""
    js = lapse_streams
    server_limit = max_payload(js)
    assert server_limit is not None and server_limit >= 1024 * 1024
    publisher = NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED)
    emitter = NatsEmitter(js, STREAMS)
    # No known max_payload: the ingress learns it from NATS's refusal (MaxPayloadError).
    blind = Ingress(publisher.publish, max_body_bytes=4 * server_limit, record=emitter.emit)
    # The server's max_payload known: the event is measured with its headers first.
    measured = Ingress(
        publisher.publish,
        max_body_bytes=server_limit,
        max_payload=server_limit,
        record=emitter.emit,
    )
    for app, size in ((blind, 2 * server_limit), (measured, server_limit - 200)):
        async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            response = await http.post("/", headers=STRUCTURED, content=structured(size))
        assert response.status_code == 413, response.text
        assert "max_payload" in response.text
    letters = await recorded(js, 2)
    assert [x.failed.reason.split(":")[0] for x in letters if x.failed] == ["413", "413"]
    assert await stored_events(js) == 0


async def test_malformed_events_are_400_with_the_reason_and_recorded(
    lapse_streams: JetStreamContext, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    js = lapse_streams
    app = await nats_ingress(js, LapseConfig())
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        garbage = await http.post("/", content=b"not an event")
        assert garbage.status_code == 400 and garbage.text.startswith("not a CloudEvent")
        broken = {**WORKFLOW, "metadata": {"name": "no-uid", "namespace": "ns"}}
        refused = await http.post("/", headers=apiserver_update(broken), content=json.dumps(broken))
        assert refused.status_code == 400 and "uid" in refused.text
    letters = await recorded(js, 2)
    reasons = [x.failed.reason for x in letters if x.failed]
    assert reasons[0].startswith("400: not a CloudEvent")
    assert reasons[1] == f"400: {refused.text}"
    # What was refused can be seen: the sender's own attributes and data.
    second = letters[1].failed
    assert second is not None and second.original is not None
    assert second.original.attributes["type"] == "dev.knative.apiserver.resource.update"
    assert second.original.data is not None and "no-uid" in second.original.data
    assert await stored_events(js) == 0

    # And `lapse dlq list --stage ingress` shows them.
    config = {"nats": {"url": nats_server.url}}
    listed = await asyncio.to_thread(
        _lapse, config, tmp_path, "dlq", "list", "--stage", "ingress", "-o", "json"
    )
    assert listed.returncode == 0, listed.stderr
    assert [row["reason"] for row in json.loads(listed.stdout)["items"]] == reasons


async def test_a_flood_is_counted_but_recorded_at_the_configured_rate(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    now = [0.0]
    app = Ingress(
        NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED).publish,
        record=NatsEmitter(js, STREAMS).emit,
        max_records_per_minute=3,
        clock=lambda: now[0],
    )
    memory = telemetry.install_in_memory()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://ingress"
        ) as http:
            for _ in range(10):
                assert (await http.post("/", content=b"junk")).status_code == 400
            await app.flush()
            now[0] += 60.0  # a minute later the budget is back
            assert (await http.post("/", content=b"junk")).status_code == 400
            await app.flush()
        assert counter(memory, INGRESS_REJECTIONS.name) == 11
        assert counter(memory, INGRESS_REJECTIONS.name, **{INGRESS_RECORDED: False}) == 7
    finally:
        memory.handle.shutdown()
        telemetry.reset()
    letters = await recorded(js, 4)
    assert len(letters) == 4
    assert letters[-1].failed is not None
    assert "(7 more refusals not recorded before this one)" in letters[-1].failed.reason


async def test_a_limit_above_the_servers_max_payload_is_refused_at_start_up(
    lapse_streams: JetStreamContext, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    server_limit = max_payload(lapse_streams)
    assert server_limit is not None
    too_big = LapseConfig.model_validate({"ingress": {"max_body_bytes": server_limit + 1}})
    with pytest.raises(ConfigError, match=r"^ingress\.max_body_bytes: .* max_payload"):
        await nats_ingress(lapse_streams, too_big)

    config = {
        "nats": {"url": nats_server.url},
        "ingress": {"max_body_bytes": server_limit + 1},
        # Read (lapse up names the cluster first) but never contacted: the limit is refused
        # before lapse up touches a cluster, whose port here nothing listens on.
        "kubernetes": {"kubeconfig": str(_unreachable_kubeconfig(tmp_path))},
    }
    port = free_port()
    result = await asyncio.to_thread(
        _lapse,
        config,
        tmp_path,
        "up",
        "--state-dir",
        str(tmp_path / "state"),
        "--listen",
        f"127.0.0.1:{port}",
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lapse: ingress.max_body_bytes: ") and "max_payload" in last


def _unreachable_kubeconfig(tmp: Path) -> Path:
    path = tmp / "unreachable.kubeconfig"
    cluster = {"server": f"https://127.0.0.1:{free_port()}", "insecure-skip-tls-verify": True}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "none", "cluster": cluster}],
                "users": [{"name": "none", "user": {"token": "unused"}}],
                "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
                "current-context": "none",
            }
        )
    )
    return path


def _lapse(config: dict[str, Any], tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp / "lapse.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "lapse.cli", "--config", str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith(("LAPSE_", "OTEL_"))},
    )


async def test_a_stream_size_limit_is_413_too(lapse_streams: JetStreamContext) -> None:
    """A stream whose max_msg_size an operator lowered refuses the message in JetStream
    (error 10054): still the sender's size, still 413."""
    js = lapse_streams
    info = await js.stream_info(STREAMS.events)
    info.config.max_msg_size = 4096
    await js.update_stream(info.config)
    app = Ingress(
        NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED).publish,
        record=NatsEmitter(js, STREAMS).emit,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://ingress"
    ) as http:
        response = await http.post("/", headers=STRUCTURED, content=structured(8192))
        await app.flush()
    assert response.status_code == 413, response.text
    [letter] = await recorded(js, 1)
    assert letter.failed is not None and letter.failed.reason.startswith("413: ")
    assert await stored_events(js) == 0
