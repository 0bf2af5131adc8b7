"""`lapse up` (a subprocess, as users run it) deleting a Workflow's artifacts in a real S3
server (SeaweedFS, built here), on the artifacts clock, after the object went on its own,
through an S3 outage.

The Workflow says where its outputs went as Argo writes it: `status.nodes[*].outputs.
artifacts[*].s3.key`, including the archived `main-logs`, in the repository named inline
in `status.artifactRepositoryRef`. lapse's watcher reads it, the planner captures the keys,
and the artifact-reaper deletes them when the NATS scheduler fires the artifacts deadline.
SeaweedFS is stopped from before that deadline until 60 s later (docs/issue: "an S3 outage
of 60 s costs nothing"): the artifacts go once it is back, none early, each due deadline
ends in exactly one outcome, and nothing is dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import hypercorn.asyncio
import hypercorn.config
import obstore
import pytest

from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port, port_open
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.timeutil import parse_rfc3339
from tests.conftest import ARTIFACT_BUCKET, KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.integration.test_artifact_reaper import client, plant, present
from tests.stack import wait_for

# One outage, as long as the promise: longer than the back-off's cap (60 s,
# lapse/runtime/outages.py), so the reaper has met the store down at its cap too.
OUTAGE = 60.0
pytestmark = [pytest.mark.kube, pytest.mark.nats]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-artifacts")) as stack:
        yield stack


def workflow_with_outputs(name: str, keys: list[str]) -> dict[str, Any]:
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    artifacts = [{"name": key.rsplit("/", 1)[-1], "s3": {"key": key}} for key in keys]
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": {"workflows.argoproj.io/completed": "true"}},
        "spec": {"entrypoint": "main"},
        "status": {
            "phase": "Succeeded", "startedAt": now, "finishedAt": now,
            "artifactRepositoryRef": {
                "default": True,
                "artifactRepository": {
                    "archiveLogs": True, "s3": {"bucket": ARTIFACT_BUCKET},
                },
            },
            "nodes": {f"{name}-1": {"outputs": {"artifacts": artifacts}}},
        },
    }  # fmt: skip


async def test_up_deletes_a_workflows_artifacts_on_their_clock_through_an_s3_outage(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in seaweedfs.env().items():  # `lapse up` finds them where S3 users keep them
        monkeypatch.setenv(key, value)
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "policies:\n"
        "  - name: clocks\n"
        "    kubernetes: {ttl: 2s}\n"
        "    artifacts: {ttl: 20s}\n"
        "safety: {max_deletions_per_second: 1000, namespaces: {include: ['*']}}\n"
        "artifacts:\n"
        "  stores:\n"
        f"    - {{name: argo, url: 's3://{ARTIFACT_BUCKET}/e2e/', endpoint: "
        f"'{seaweedfs.endpoint}', region: {REGION}, min_prefix_depth: 3}}\n"
    )
    ns = kube.namespace(f"art-{uuid.uuid4().hex[:6]}")
    base = f"e2e/{ns}/wf"
    outputs = [f"{base}/wf-1/main.log", f"{base}/wf-1/model.tgz"]
    beside = [f"{base}/wf-1/main.log.1", f"{base}/wf-2/main.log", f"other/{base}/wf-1/main.log"]
    s3 = client(seaweedfs)
    await plant(s3, *outputs, *beside)

    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        await kube.workflows.create(ns, workflow_with_outputs("wf", outputs))

        async def object_gone() -> bool:
            return not (await kube.workflows.list(ns))["items"]

        await wait_for(object_gone, timeout=60, interval=0.3)
        assert set(outputs) <= await present(s3), "artifacts went with the object"
        # The S3 server goes away before the artifacts deadline and stays away past it.
        down = datetime.now(UTC)
        seaweedfs.stop()
        await asyncio.sleep(OUTAGE)  # the outage itself, not a readiness wait
        up_again = datetime.now(UTC)
        seaweedfs.start()
        back = time.monotonic()
        s3 = client(seaweedfs)
        # Nothing went while the store was away (nothing could): every output is still there.
        assert set(outputs) <= await present(s3), "artifacts went during the outage"

        async def artifacts_gone() -> bool:
            return not set(outputs) & await present(s3)

        # After the store returns, the next try comes within the back-off's cap (60 s).
        await wait_for(artifacts_gone, timeout=150, interval=0.5)
        took = time.monotonic() - back
        assert set(beside) <= await present(s3)

        async def recorded() -> list[dict[str, Any]]:
            rows = lapse_json("history", "-n", ns, config=config)
            return rows if any(r["target"] == "artifacts" for r in rows) else []

        history = await wait_for(recorded, timeout=30, interval=0.5)
        # Each due deadline ended in exactly one outcome: no failure, no duplicate, no
        # `rescheduled` while the store was away (the wait is a retry, not an outcome).
        outcomes = Counter((row["target"], row["outcome"]) for row in history)
        assert outcomes == {("kubernetes", "deleted"): 1, ("artifacts", "deleted"): 1}, history
        # None early: each went at or after its deadline.
        assert all(row["latencySeconds"] >= 0 for row in history), history
        (artifacts,) = [row for row in history if row["target"] == "artifacts"]
        # The outage covered the artifacts deadline: the reaper met the store down when due.
        assert down < parse_rfc3339(artifacts["deadline"]) < up_again, (down, artifacts, up_again)
        assert parse_rfc3339(artifacts["time"]) > up_again
        # And the outcome says what it deleted: both outputs, nothing beside them.
        assert (artifacts["objectsDeleted"], artifacts["bytesFreed"]) == (
            2,
            sum(len(f"content of {key}") for key in outputs),
        ), artifacts
        status = lapse_json("status", config=config)
        assert status["deadLetters"] == 0
        assert lapse_json("dlq", "list", config=config) == []
        assert "waiting out a transient failure" in (tmp_path / "up.log").read_text()
        print(f"S3 outage {OUTAGE:.0f} s; artifacts deleted {took:.1f} s after it ended")
    finally:
        if seaweedfs.process is None:
            seaweedfs.start()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


@contextlib.asynccontextmanager
async def writing_before_the_delete(
    upstream: str, key: str, write: Callable[[], Awaitable[None]]
) -> AsyncIterator[str]:
    """The S3 server behind a loopback pass-through that, when `key`'s delete first
    arrives (a DELETE of it, or a DeleteObjects naming it), runs `write` against the
    real server and then forwards the delete: a write landing after everything lapse
    looked at and before its delete, the moment no test can otherwise hit. Requests go
    on byte for byte, the signed Host header with them."""
    pending = [write]
    client = httpx.AsyncClient(timeout=60)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path, query = scope["raw_path"].decode(), scope["query_string"].decode()
        deleting = (scope["method"] == "DELETE" and path.endswith(f"/{key}")) or (
            scope["method"] == "POST" and "delete" in query and f"<Key>{key}</Key>" in body.decode()
        )
        if deleting and pending:
            await pending.pop()()
        request = client.build_request(
            scope["method"], f"{upstream}{path}" + (f"?{query}" if query else ""),
            headers=[(k, v) for k, v in scope["headers"]], content=body,
        )  # fmt: skip
        response = await client.send(request, stream=True)
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
        headers = [
            (k, v)
            for k, v in response.headers.raw
            if k.lower() not in (b"connection", b"transfer-encoding")
        ]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        await send({"type": "http.response.body", "body": raw})

    port = free_port()
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    stop = asyncio.Event()
    task = asyncio.create_task(hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]

    async def listening() -> bool:
        return port_open(port)

    await wait_for(listening, timeout=10, interval=0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()
    assert not pending, f"no delete of {key} came"


async def test_up_keeps_an_artifact_written_again_just_before_its_delete(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`lapse up` deletes a Workflow's outputs; one of them is written again after lapse
    listed it and before its delete reaches the store. The store deletes each output only
    if it is still the object lapse judged (S3 If-Match on the etag listed): the one
    written again is kept, whole, and the outcome says so; the others go."""
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    ns = kube.namespace(f"race-{uuid.uuid4().hex[:6]}")
    base = f"e2e/{ns}/wf"
    outputs = [f"{base}/wf-1/main.log", f"{base}/wf-1/model.tgz", f"{base}/wf-1/metrics.json"]
    rewritten = outputs[1]
    s3 = client(seaweedfs)
    await plant(s3, *outputs)

    async def written_again() -> None:
        await obstore.put_async(s3, rewritten, b"a new model, same key")

    async with writing_before_the_delete(seaweedfs.endpoint, rewritten, written_again) as s3_url:
        config = tmp_path / "lapse.yaml"
        config.write_text(
            f"nats: {{url: '{own_nats.url}'}}\n"
            f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
            "policies:\n"
            "  - name: clocks\n"
            "    kubernetes: {ttl: 1s}\n"
            "    artifacts: {ttl: 3s}\n"
            "safety: {max_deletions_per_second: 1000, namespaces: {include: ['*']}}\n"
            "artifacts:\n"
            "  stores:\n"
            f"    - {{name: argo, url: 's3://{ARTIFACT_BUCKET}/e2e/', endpoint: "
            f"'{s3_url}', region: {REGION}, min_prefix_depth: 3}}\n"
        )
        up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
        await up.start()
        try:
            await kube.workflows.create(ns, workflow_with_outputs("wf", outputs))

            async def recorded() -> list[dict[str, Any]]:
                rows = lapse_json("history", "-n", ns, config=config)
                return [r for r in rows if r["target"] == "artifacts"]

            (artifacts,) = await wait_for(recorded, timeout=60, interval=0.5)
        finally:
            assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert await present(s3, f"{base}/") == {rewritten}, "the output written again was deleted"
    body = await (await obstore.get_async(s3, rewritten)).bytes_async()
    assert bytes(body) == b"a new model, same key"
    assert artifacts["outcome"] == "deleted", artifacts
    assert artifacts["objectsDeleted"] == 2, artifacts
    assert "kept 1 objects written again since they were listed" in artifacts["detail"]
