"""SIGTERM (what Kubernetes sends a pod) finishes the work in flight and exits within the
grace period, every time: `lapse up` as a subprocess, stopped again and again in the
middle of deletions, against a real kube-apiserver and NATS; and once while the API server
cannot answer at all (its etcd killed), when the work in flight cannot finish and is left
for the next process instead of holding this one.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lapse.edges import nats
from lapse.embedded.nats import EmbeddedNats
from tests.conftest import KubeStack
from tests.e2e.apiserver_audit import audited_kube_stack, check_one_delete_each, deletes
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

ROUNDS = 5
PER_ROUND = 30
# Kubernetes' default terminationGracePeriodSeconds: SIGKILL follows this long after SIGTERM.
GRACE = 30.0
REAPER = "lapse-object-reaper-due"  # the reaper's durable consumer


@pytest.fixture
def audited_kube(tmp_path: Path) -> Iterator[tuple[KubeStack, Path]]:
    with audited_kube_stack(tmp_path / "kube") as (stack, log):
        yield stack, log


def write_config(path: Path, nats_url: str, kube: KubeStack) -> Path:
    # A low deletion rate keeps many due events in flight (waiting for the rate limiter)
    # when the signal comes.
    path.write_text(
        yaml.safe_dump(
            {
                "nats": {"url": nats_url},
                "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
                "safety": {"max_deletions_per_second": 5, "namespaces": {"include": ["*"]}},
            }
        )
    )
    return path


async def unacknowledged(url: str) -> int:
    """Due events the reaper has been given and not yet acknowledged (or handed back)."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().consumer_info("LAPSE_SCHED", REAPER)
        return int(info.num_ack_pending or 0)
    finally:
        await nc.close()


async def test_sigterm_finishes_in_flight_work_and_exits_every_time(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, audit_log = audited_kube
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube)
    ns = kube.namespace("sigterm")
    names: list[str] = []
    exits: list[float] = []
    in_flight: list[int] = []
    for round_ in range(ROUNDS):
        up = LapseUp(config, tmp_path / "state", tmp_path / f"up-{round_}.log")
        await up.start()
        batch = [f"r{round_}-{i}" for i in range(PER_ROUND)]
        names += batch
        for name in batch:
            await kube.workflows.create(
                ns, finished_workflow(name, annotations={"lapse.dev/ttl": "1s"})
            )

        async def deleting(batch: list[str] = batch) -> bool:
            left = {w["metadata"]["name"] for w in (await kube.workflows.list(ns))["items"]}
            return bool(set(batch) - left)

        await wait_for(deleting, timeout=60, interval=0.2)
        in_flight.append(await unacknowledged(own_nats.url))
        began = time.monotonic()
        code = up.stop(signal.SIGTERM, timeout=GRACE + 30)
        exits.append(time.monotonic() - began)
        assert code == 0, up.log.read_text()[-3000:]
        assert exits[-1] < GRACE, f"round {round_}: exit took {exits[-1]:.1f}s"
        # Everything it held was finished and acknowledged before it exited.
        assert await unacknowledged(own_nats.url) == 0, f"round {round_}"
        assert "cancelling" not in up.log.read_text(), "nothing was cut short"
    # The first round may be stopped before most of its deadlines fire; the others not.
    assert sum(1 for n in in_flight if n > 0) >= ROUNDS - 2, in_flight

    # Whatever was not yet due or not yet taken is finished by the next lapse.
    last = LapseUp(config, tmp_path / "state", tmp_path / "up-last.log")
    await last.start()
    try:

        async def all_gone() -> bool:
            return not (await kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=120, interval=0.5)
        await asyncio.sleep(1)  # the last DELETE's audit line follows its commit
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        status = lapse_json("status", config=config)
    finally:
        assert last.stop() == 0, last.log.read_text()[-3000:]
    outcomes = Counter((row["name"], row["outcome"]) for row in history)
    # One outcome per object, and each `deleted`: no DELETE was left unrecorded by a process
    # that stopped (the next one would have found the object gone: `already_gone`).
    assert set(outcomes) == {(name, "deleted") for name in names}, outcomes
    assert set(outcomes.values()) == {1}
    check_one_delete_each(deletes(audit_log, ns), names)
    assert status["deadLetters"] == 0
    print(
        f"\nSIGTERM x{ROUNDS}: in flight at the signal {in_flight}, exited after "
        f"{', '.join(f'{s:.1f}s' for s in exits)}; {len(names)} deleted once each"
    )


async def test_sigterm_while_the_api_server_cannot_answer_exits_within_the_grace_period(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, audit_log = audited_kube
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube)
    ns = kube.namespace("sigterm-stuck")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    names = [f"wf-{i}" for i in range(10)]
    for name in names:
        body = finished_workflow(name, annotations={"lapse.dev/ttl": "4s"})
        await kube.workflows.create(ns, body)
    await asyncio.sleep(1)  # planned
    # Without etcd the API server takes requests and answers none: the reaper's calls hang.
    kube.server.kill_etcd()
    await asyncio.sleep(8)  # due, and their reads in flight

    began = time.monotonic()
    code = up.stop(signal.SIGTERM, timeout=GRACE + 60)
    took = time.monotonic() - began
    assert code == 0, up.log.read_text()[-3000:]
    assert took < GRACE, f"exit took {took:.1f}s"

    await asyncio.to_thread(kube.server.restart_etcd)
    again = LapseUp(config, tmp_path / "state", tmp_path / "up-again.log")
    await again.start()
    try:

        async def all_gone() -> bool:
            return not (await kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=120, interval=0.5)
        await asyncio.sleep(1)
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        status = lapse_json("status", config=config)
    finally:
        assert again.stop() == 0, again.log.read_text()[-3000:]
    assert Counter(row["name"] for row in history) == Counter(names), "one outcome each"
    check_one_delete_each(deletes(audit_log, ns), names)
    assert status["deadLetters"] == 0
    print(f"\nSIGTERM with etcd down: exited after {took:.1f}s; all {len(names)} deleted after")
