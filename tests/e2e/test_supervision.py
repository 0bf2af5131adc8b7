"""No dependency's outage ends `lapse up` (a subprocess, on a real kube-apiserver with the
policy CRDs installed, and a real NATS): every background task waits out its transient
faults under one supervisor, says so in `lapse status`, and resumes; the runs that fell due
meanwhile are deleted afterwards, none early, none lost.

The issue's finding: the API server stopped (its port refusing) for 60 s while 40 runs fall
due; `lapse up` once exited with rc=1 ("policy watcher crashed: ... Connection refused").
The process running when it stops survives the outage on the old code too (its policy
watch retried); what ended it is a policy list meeting the refusal, which happens when
`lapse up` starts (or, mid-run, re-lists after 410 Gone) while the API server is away. So
the process is also replaced in the outage, as a Deployment's pod rescheduled then would
be: the old code's new process exited with rc=1 at once. Then NATS stops, for the same
process. Each test reports what it measured on stdout (`pytest -s` shows it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.embedded.nats import EmbeddedNats
from lapse.events.run import Target
from lapse.operations.audit import pending_schedules
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_engines import config_file
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.e2e.test_outages import outcomes_by_name
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

OUTAGE_SECONDS = 60.0
RUNS = 40
NATS_OUTAGE_SECONDS = 10.0
SCHEDULES = Streams().schedule


@pytest.fixture(scope="module")
def own_kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server (with the policy CRDs, as kube_stack installs them): a test here
    # stops it.
    with kube_stack(tmp_path_factory.mktemp("kube-supervised")) as stack:
        yield stack


def waiting_tasks(status: dict[str, Any], process: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The background tasks of `process` that `lapse status` shows waiting out a fault."""
    return {t["task"]: t for t in status["tasks"] if t["process"].endswith(f"-{process.pid}")}


def alive(up: LapseUp, when: str) -> subprocess.Popen[bytes]:
    assert up.process is not None
    assert up.process.poll() is None, f"lapse up exited {when}:\n{up.log.read_text()[-3000:]}"
    return up.process


def emptied(kube: KubeStack, ns: str, up: LapseUp, when: str) -> Callable[[], Awaitable[bool]]:
    """Whether every run in `ns` is gone; `up` must still be running meanwhile."""

    async def check() -> bool:
        alive(up, when)
        return not (await kube.workflows.list(ns))["items"]

    return check


def spawn(up: LapseUp) -> None:
    """Start `up` without waiting for it to run (it cannot while the API server is away)."""
    with up.log.open("ab") as out:
        up.process = subprocess.Popen(up.args, stdout=out, stderr=subprocess.STDOUT)


async def test_what_retrying_cannot_change_ends_lapse_up_saying_why(
    tmp_path: Path, own_nats: EmbeddedNats, own_kube: KubeStack
) -> None:
    """Credentials the API server refuses (401) are not an outage: retried, they would be
    refused forever while the process looked alive. It exits, naming the answer."""
    kubeconfig = tmp_path / "refused.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(own_kube.server.kubeconfig(token="not-a-valid-token")))
    refused = dataclasses.replace(own_kube, kubeconfig=kubeconfig)
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, refused)
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    spawn(up)
    assert up.process is not None
    try:
        code = await asyncio.to_thread(up.process.wait, 60)
    finally:
        up.stop(signal.SIGKILL)
    log = up.log.read_text()
    assert code == 1, log[-3000:]
    assert "API server refused lapse (answered 401" in log, log[-3000:]
    assert "lapse stops (retrying cannot change it)" in log, log[-3000:]
    assert "lapse is running" not in log


async def test_the_api_server_stopped_for_a_minute_ends_nothing_and_loses_no_run(
    tmp_path: Path, own_nats: EmbeddedNats, own_kube: KubeStack
) -> None:
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, own_kube)
    ns = own_kube.namespace("supervised")
    first = LapseUp(config, tmp_path / "state", tmp_path / "first.log")
    # The same process's replacement (a Deployment's pod rescheduled in the outage).
    second = LapseUp(config, tmp_path / "state", tmp_path / "second.log")
    await first.start()
    server = own_kube.server
    try:
        created = time.monotonic()
        for i in range(RUNS):
            # Due 25..64 s after finishing: every one inside the outage below.
            body = finished_workflow(f"wf-{i}", annotations={"lapse.dev/ttl": f"{25 + i}s"})
            await own_kube.workflows.create(ns, body)
        nc = await connect(own_nats.url)
        try:

            async def planned() -> bool:
                pending = await pending_schedules(nc.jetstream(), SCHEDULES, Target.KUBERNETES)
                return pending.count == RUNS

            await wait_for(planned, timeout=20, interval=0.2)
        finally:
            await nc.close()
        assert time.monotonic() - created < 25, "planned before the first deadline"
        server.kill_apiserver()
        down_at = datetime.now(UTC)
        down = time.monotonic()

        # While it is away, `lapse up` keeps running, and `lapse status` names the tasks
        # waiting for it, why, since when and when they try again.
        def tasks_waiting(up: LapseUp, names: set[str]) -> Callable[[], Awaitable[Any]]:
            async def check() -> dict[str, Any] | None:
                process = alive(up, "during the outage")
                status = lapse_json("status", "--recent", "0", config=config)
                tasks = waiting_tasks(status, process)
                return tasks if names <= tasks.keys() else None

            return check

        watchers = {"watcher argo-workflow", "policy watcher"}
        tasks = await wait_for(tasks_waiting(first, watchers), timeout=30, interval=1.0)
        for name in watchers:
            task = tasks[name]
            assert task["reason"].startswith("API server unreachable"), task
            assert "refused" in task["reason"], task
            assert task["state"] == "waiting" and 0 <= task["nextTryInSeconds"] <= 36, task
            assert 0 < task["seconds"] < OUTAGE_SECONDS, task
        # Replaced while the API server is still away: the new process waits to read the
        # policy objects, saying so, instead of exiting (a CrashLoopBackOff).
        stopping = time.monotonic()
        assert first.stop(signal.SIGTERM) == 0, first.log.read_text()[-3000:]
        stopped_in = time.monotonic() - stopping
        spawn(second)
        tasks = await wait_for(tasks_waiting(second, {"policy watcher"}), timeout=30, interval=1.0)
        assert tasks["policy watcher"]["reason"].startswith("API server unreachable"), tasks
        assert "lapse is running" not in second.log.read_text()
        while time.monotonic() - down < OUTAGE_SECONDS:
            alive(second, "during the outage")
            await asyncio.sleep(1.0)
        await asyncio.to_thread(server.restart_apiserver)
        up_at = time.monotonic()

        await wait_for(emptied(own_kube, ns, second, "after the outage"), timeout=90, interval=0.5)
        recovered = time.monotonic() - up_at
        assert "lapse is running" in second.log.read_text()
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        outcomes = outcomes_by_name(history, "kubernetes")
        assert {name for name, _ in outcomes} == {f"wf-{i}" for i in range(RUNS)}, outcomes
        assert all(n == 1 for n in outcomes.values()), "one outcome per run"
        assert {outcome for _, outcome in outcomes} <= {"deleted", "already_gone"}, outcomes
        assert all(row["latencySeconds"] >= 0 for row in history), "none deleted early"
        assert lapse_json("status", "--recent", "0", config=config)["deadLetters"] == 0

        # NATS away from the same process: a run that finishes meanwhile is held by its
        # watcher (neither lost nor the end of the process) and deleted once NATS is back.
        own_nats.stop()
        nats_down = time.monotonic()
        late = finished_workflow("wf-nats", annotations={"lapse.dev/ttl": "2s"})
        await own_kube.workflows.create(ns, late)
        while time.monotonic() - nats_down < NATS_OUTAGE_SECONDS:
            alive(second, "while NATS was away")
            await asyncio.sleep(1.0)
        await asyncio.to_thread(own_nats.start, healthy=True)
        nats_up = time.monotonic()

        await wait_for(emptied(own_kube, ns, second, "after NATS"), timeout=60, interval=0.5)
        nats_recovered = time.monotonic() - nats_up
        history = lapse_json("history", "-n", ns, "--name", "wf-nats", config=config)
        assert [(r["outcome"], r["latencySeconds"] >= 0) for r in history] == [("deleted", True)]

        async def nothing_waits() -> bool:
            status = lapse_json("status", "--recent", "0", config=config)
            return not waiting_tasks(status, alive(second, "after the outage"))

        await wait_for(nothing_waits, timeout=30, interval=1.0)
        print(
            f"\nAPI server stopped {up_at - down:.0f}s from {down_at:%H:%M:%S}, {RUNS} runs due "
            f"in it; lapse up replaced in it (the old one stopped in {stopped_in:.1f}s), the "
            f"new one waited; all deleted {recovered:.1f}s after the API server returned, "
            f"lost 0, none early, one outcome each; NATS stopped {nats_up - nats_down:.0f}s, "
            f"the run finished in it deleted {nats_recovered:.1f}s after it returned"
        )
    finally:
        for up in (first, second):
            if up.process is not None:
                assert up.stop(signal.SIGINT) == 0, up.log.read_text()[-3000:]
