"""No dependency's outage ends `lapse up` (a subprocess, on a real kube-apiserver with the
policy CRDs installed, and a real NATS): every background task waits out its transient
faults under one supervisor, says so in `lapse status`, and resumes; the runs that fell due
meanwhile are deleted afterwards, none early, none lost.

The issue's finding, exactly: the API server stopped (its port refusing) for 60 s while 40
runs fall due. `lapse up` once exited with rc=1 ("policy watcher crashed: ... Connection
refused"). Each test reports what it measured on stdout (`pytest -s` shows it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lapse.embedded.nats import EmbeddedNats
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.e2e.test_outages import outcomes_by_name
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

OUTAGE_SECONDS = 60.0
RUNS = 40


@pytest.fixture
def own_kube(tmp_path: Path) -> Iterator[KubeStack]:
    # Its own API server (with the policy CRDs, as kube_stack installs them): this test
    # stops it.
    with kube_stack(tmp_path / "kube") as stack:
        yield stack


def write_config(path: Path, nats_url: str, kubeconfig: Path) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kubeconfig}'}}\n"
        "safety: {max_deletions_per_second: 500, namespaces: {include: ['*']}}\n"
    )
    return path


def waiting_tasks(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The background tasks `lapse status` shows waiting out a fault."""
    return {t["task"]: t for t in status["tasks"]}


async def test_the_api_server_stopped_for_a_minute_ends_nothing_and_loses_no_run(
    tmp_path: Path, own_nats: EmbeddedNats, own_kube: KubeStack
) -> None:
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, own_kube.kubeconfig)
    ns = own_kube.namespace("supervised")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    server = own_kube.server
    try:
        created = time.monotonic()
        for i in range(RUNS):
            # Due 10..49 s after finishing: every one inside the outage below.
            ttl = 10 + i
            body = finished_workflow(f"wf-{i}", annotations={"lapse.dev/ttl": f"{ttl}s"})
            await own_kube.workflows.create(ns, body)

        async def planned() -> bool:
            status = lapse_json("status", "--recent", "0", config=config)
            return bool(status["pending"]["kubernetes"]["count"] == RUNS)

        await wait_for(planned, timeout=20, interval=0.5)
        assert time.monotonic() - created < 10, "planned before the first deadline"
        server.kill_apiserver()
        down_at = datetime.now(UTC)
        down = time.monotonic()

        # While it is away: `lapse up` keeps running, and `lapse status` names the tasks
        # waiting for it, with why.
        async def watchers_waiting() -> dict[str, Any] | None:
            assert up.process is not None and up.process.poll() is None, (
                f"lapse up exited:\n{up.log.read_text()[-3000:]}"
            )
            status: dict[str, Any] = lapse_json("status", "--recent", "0", config=config)
            tasks = waiting_tasks(status)
            ready = {"watcher Workflow", "policy watcher"} <= tasks.keys()
            return status if ready else None

        during = await wait_for(watchers_waiting, timeout=OUTAGE_SECONDS - 10, interval=1.0)
        tasks = waiting_tasks(during)
        for name in ("watcher Workflow", "policy watcher"):
            task = tasks[name]
            assert task["reason"].startswith("API server unreachable"), task
            assert "refused" in task["reason"], task
            assert task["state"] == "waiting" and 0 <= task["nextTryInSeconds"] <= 36, task
            assert 0 < task["seconds"] < OUTAGE_SECONDS, task
        assert during["deadLetters"] == 0
        while time.monotonic() - down < OUTAGE_SECONDS:
            assert up.process is not None and up.process.poll() is None, (
                f"lapse up exited during the outage:\n{up.log.read_text()[-3000:]}"
            )
            await asyncio.sleep(1.0)
        await asyncio.to_thread(server.restart_apiserver)
        up_at = time.monotonic()

        async def all_gone() -> bool:
            assert up.process is not None and up.process.poll() is None, (
                f"lapse up exited after the outage:\n{up.log.read_text()[-3000:]}"
            )
            return not (await own_kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=90, interval=0.5)
        recovered = time.monotonic() - up_at
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        outcomes = outcomes_by_name(history, "kubernetes")
        assert {name for name, _ in outcomes} == {f"wf-{i}" for i in range(RUNS)}, outcomes
        assert all(n == 1 for n in outcomes.values()), "one outcome per run"
        assert {outcome for _, outcome in outcomes} <= {"deleted", "already_gone"}, outcomes
        assert all(row["latencySeconds"] >= 0 for row in history), "none deleted early"

        async def recovered_in_status() -> bool:
            status = lapse_json("status", "--recent", "0", config=config)
            return not {"watcher Workflow", "policy watcher"} & waiting_tasks(status).keys()

        await wait_for(recovered_in_status, timeout=30, interval=1.0)
        print(
            f"\nAPI server stopped {up_at - down:.0f}s from {down_at:%H:%M:%S}, {RUNS} runs due "
            f"in it: lapse up kept running, all deleted {recovered:.1f}s after it returned, "
            f"lost 0, none early"
        )
    finally:
        assert up.stop(signal.SIGINT) == 0, up.log.read_text()[-3000:]
