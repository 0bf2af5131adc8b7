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
import json
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
from tests.e2e.test_outages import Blackhole, outcomes_by_name
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

OUTAGE_SECONDS = 60.0
RUNS = 40
NATS_OUTAGE_SECONDS = 10.0
BLACK_HOLE_SECONDS = 18.0
BLACK_HOLED_RUNS = 5
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


async def test_a_black_holed_api_server_is_waited_out_and_what_finished_in_it_is_deleted(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    """The API server stops answering without refusing (packets dropped, a proxy that
    accepts and never replies): the open watches go silent, new connections hang. Without
    a client-side read timeout a watch waited forever, so runs that finished meanwhile were
    never planned, even once the API server answered again. With one, the watchers wait it
    out, `lapse status` says so, and the runs are deleted after it, none early.

    The Blackhole proxy in front of the real kube-apiserver is the only way to provoke a
    black hole here without root network tricks (iptables DROP, tc); the shared API server
    keeps serving the test (and the other tests) directly. Short timeouts keep it short:
    a watch asks for 4 s and gives up after 7 s of silence, a request after 3 s."""
    url = kube.server.url.rsplit(":", 1)
    hole = Blackhole(url[0].removeprefix("https://"), int(url[1]))
    await hole.start()
    through = kube.server.kubeconfig()
    through["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{hole.port}"  # type: ignore[index]
    kubeconfig = tmp_path / "through-the-hole.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(through))
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kubeconfig}', request_timeout: 3, watch_timeout: 4}}\n"
        "safety: {max_deletions_per_second: 200, namespaces: {include: ['*']}}\n"
    )
    # The CLI's own questions go to the API server directly.
    direct = config_file(tmp_path / "direct.yaml", own_nats.url, kube)
    ns = kube.namespace("black-holed")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        # Through the proxy, lapse works: a run is deleted at its deadline.
        await kube.workflows.create(
            ns, finished_workflow("wf-before", annotations={"lapse.dev/ttl": "1s"})
        )
        await wait_for(emptied(kube, ns, up, "before the black hole"), timeout=20, interval=0.3)

        hole.sever(drop=True)
        down = time.monotonic()
        for i in range(BLACK_HOLED_RUNS):
            body = finished_workflow(f"wf-{i}", annotations={"lapse.dev/ttl": "2s"})
            await kube.workflows.create(ns, body)

        async def watchers_waiting() -> dict[str, Any] | None:
            process = alive(up, "during the black hole")
            tasks = waiting_tasks(lapse_json("status", "--recent", "0", config=direct), process)
            return tasks if {"watcher argo-workflow", "policy watcher"} <= tasks.keys() else None

        tasks = await wait_for(watchers_waiting, timeout=BLACK_HOLE_SECONDS, interval=1.0)
        seen_waiting = time.monotonic() - down
        for name in ("watcher argo-workflow", "policy watcher"):
            assert tasks[name]["state"] == "waiting", tasks
            assert "did not answer in time" in tasks[name]["reason"], tasks
        while time.monotonic() - down < BLACK_HOLE_SECONDS:
            alive(up, "during the black hole")
            await asyncio.sleep(1.0)
        # Nothing the black hole hid was deleted during it (its reaper sees nothing).
        left = {w["metadata"]["name"] for w in (await kube.workflows.list(ns))["items"]}
        assert left == {f"wf-{i}" for i in range(BLACK_HOLED_RUNS)}, left
        hole.mend()
        mended = time.monotonic()

        await wait_for(emptied(kube, ns, up, "after the black hole"), timeout=30, interval=0.5)
        recovered = time.monotonic() - mended
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=direct)
        outcomes = outcomes_by_name(history, "kubernetes")
        names = {"wf-before", *(f"wf-{i}" for i in range(BLACK_HOLED_RUNS))}
        assert {name for name, _ in outcomes} == names, json.dumps(history)[-3000:]
        assert {outcome for _, outcome in outcomes} == {"deleted"}, outcomes
        assert all(row["latencySeconds"] >= 0 for row in history), "none deleted early"
        print(
            f"\nAPI server black-holed {mended - down:.0f}s: the watchers shown waiting "
            f"{seen_waiting:.1f}s in; {BLACK_HOLED_RUNS} runs finished in it, all deleted "
            f"{recovered:.1f}s after it ended, none early"
        )
    finally:
        if up.process is not None:
            assert up.stop(signal.SIGINT) == 0, up.log.read_text()[-3000:]
        await hole.stop()
