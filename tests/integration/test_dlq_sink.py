"""The Broker's dead-letter sink (`lapse-dlq-sink`), run as its container runs it
(`python -m lapse.runtime.dlq_sink`), against real NATS: what the Broker gives up on lands
in lapse's dead letters, where `lapse dlq` finds it and can replay it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cloudevents.core.bindings.http import to_binary_event
from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import parse_payload
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import from_nats, to_nats
from lapse.events.run import Target
from lapse.events.subjects import dlq_subject, due_subject
from lapse.events.types import EventType
from tests.integration.test_bridge import due_event

pytestmark = [pytest.mark.nats]

LAPSE = Path(sys.executable).with_name("lapse")


async def lapse(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [str(LAPSE), *args], env=env, capture_output=True, text=True
    )


@pytest.fixture
def dlq_sink(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "LAPSE_NATS__URL": nats_server.url}
    process = subprocess.Popen(
        [sys.executable, "-m", "lapse.runtime.dlq_sink", "--listen", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "sink.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                pytest.fail(f"dlq sink exited: {(tmp_path / 'sink.log').read_text()}")
            subprocess.run(["sleep", "0.1"], check=True)
        else:
            pytest.fail("dlq sink never ready")
        yield url
    finally:
        process.terminate()
        assert process.wait(10) == 0


async def test_a_dead_lettered_due_event_is_stored_and_replayable(
    nats_server: EmbeddedNats, lapse_streams: JetStreamContext, dlq_sink: str
) -> None:
    event = due_event()
    # What the scheduler fired (the bridge took it from there to the Broker): a due event is
    # replayed only as lapse stored it.
    fired = to_nats(event)
    await lapse_streams.publish(
        due_subject(Target.KUBERNETES, parse_payload(event, CleanupDue).run.uid),
        fired.body,
        stream=Streams().schedule,
        headers=fired.headers,
    )
    event.get_attributes()["knativeerrorcode"] = "503"
    event.get_attributes()["knativeerrordest"] = "http://lapse-object-reaper.lapse-system.svc"
    message = to_binary_event(event)
    async with httpx.AsyncClient() as client:
        answer = await client.post(dlq_sink, headers=dict(message.headers), content=message.body)
        refused = await client.post(dlq_sink, content=b"not an event")
    assert answer.status_code == 202
    assert refused.status_code == 400

    stored = await lapse_streams.get_last_msg(Streams().dlq, dlq_subject(EventType.CLEANUP_FAILED))
    failed = from_nats(stored.headers, stored.data)
    due = parse_payload(event, CleanupDue)
    data = failed.get_data()
    assert isinstance(data, dict)
    assert data["stage"] == "broker"
    assert data["run"]["uid"] == due.run.uid and data["target"] == "kubernetes"
    assert "503" in data["reason"] and "lapse-object-reaper" in data["reason"]

    # `lapse dlq` sees it, and would re-issue the deletion where the scheduler fires it.
    env = {**os.environ, "LAPSE_NATS__URL": nats_server.url}
    listed = await lapse(env, "dlq", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["items"]
    assert [row["uid"] for row in rows if row["stage"] == "broker"] == [due.run.uid]
    replay = await lapse(env, "dlq", "replay", "--all", "--dry-run", "-o", "json")
    assert replay.returncode == 0, replay.stderr
    assert f"lapse.due.kubernetes.{due.run.uid}" in replay.stdout
