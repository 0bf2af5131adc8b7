"""`lapse reconcile` on a cluster holding 5,000 finished, already-expired workflows
schedules and drains them all.

The fresh-install case: the runs finished long before lapse was there. To prove that
reconcile (not `lapse up`'s own start-up listing) scheduled them, reconcile runs first,
with nothing else of lapse running, and must report every run scheduled; `lapse up` is
started afterwards and its reapers drain the due events at the configured rate.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from lapse.edges.kubernetes import Workflows
from lapse.embedded.nats import EmbeddedNats
from lapse.events.timeutil import parse_rfc3339
from tests.conftest import KubeStack
from tests.e2e.test_lapse_up import LapseUp
from tests.stack import expired_workflow, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

COUNT = int(os.environ.get("LAPSE_BACKLOG_COUNT", "5000"))
CREATE_PARALLEL = 16
RATE_LIMIT = 2000  # deletions/s: high, so the measured rate is what the pipeline can do


def write_config(path: Path, nats_url: str, kube: KubeStack) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "safety:\n"
        "  namespaces: {include: ['*']}\n"
        f"  max_deletions_per_second: {RATE_LIMIT}\n"
        # The brake exists for exactly this volume; here the volume is expected.
        f"  mass_deletion_brake: {{max_due: {COUNT * 2}}}\n"
    )
    return path


def lapse(config: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lapse.cli", "--config", str(config), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


async def create_backlog(workflows: Workflows, namespace: str, count: int) -> None:
    finished_at = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    slots = asyncio.Semaphore(CREATE_PARALLEL)

    async def one(i: int) -> None:
        async with slots:
            await workflows.create(namespace, expired_workflow(f"old-{i:05d}", finished_at))

    await asyncio.gather(*(one(i) for i in range(count)))


async def remaining(workflows: Workflows, namespace: str) -> int:
    """How many Workflows the namespace holds, from a one-item page (the server counts)."""
    page = await workflows.list(namespace, limit=1)
    return len(page["items"]) + int(page["metadata"].get("remainingItemCount") or 0)


@pytest.mark.timeout(3600)
async def test_reconcile_schedules_and_lapse_up_drains_a_backlog(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube)
    ns = kube.namespace(f"backlog-{uuid.uuid4().hex[:6]}")
    workflows = kube.workflows

    started = time.monotonic()
    await create_backlog(workflows, ns, COUNT)
    created_in = time.monotonic() - started
    assert await remaining(workflows, ns) == COUNT

    applied = lapse(config, "infra", "apply")
    assert applied.returncode == 0, applied.stderr
    started = time.monotonic()
    reconciled = lapse(config, "reconcile", "-n", ns, "-o", "json")
    reconcile_in = time.monotonic() - started
    assert reconciled.returncode == 0, reconciled.stderr
    summary = json.loads(reconciled.stdout)
    runs = summary["runs"]
    assert (runs["listed"], runs["scheduled"], runs["unchanged"]) == (COUNT, COUNT, 0)
    assert runs["deadlines"] == {"kubernetes": COUNT, "database": 0, "artifacts": 0}
    assert (runs["failed"], runs["errors"]) == (0, 0)
    assert "done" in reconciled.stderr  # plain progress lines: stderr is not a terminal
    # Reconcile only schedules: nothing is deleted until a reaper runs.
    assert await remaining(workflows, ns) == COUNT

    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    drain_started = time.monotonic()
    try:

        async def drained() -> bool:
            return await remaining(workflows, ns) == 0

        await wait_for(drained, timeout=max(600.0, COUNT / 10), interval=1.0)
        drain_in = time.monotonic() - drain_started
        history = lapse(config, "history", "-n", ns, "--target", "kubernetes", "-o", "json")
        assert history.returncode == 0, history.stderr
        rows = json.loads(history.stdout)["items"]
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]

    deleted = [row for row in rows if row["outcome"] == "deleted"]
    assert len(deleted) == COUNT
    assert len({row["name"] for row in deleted}) == COUNT, "no Workflow is deleted twice"
    assert all(row["latencySeconds"] >= 0 for row in deleted), "nothing before its deadline"
    outcomes = Counter(row["outcome"] for row in rows)
    # `lapse up` lists finished workflows when it starts, and may plan a run whose due event
    # is still queued once more: that second event finds the object gone.
    assert set(outcomes) <= {"deleted", "already_gone"}, outcomes
    times = sorted(parse_rfc3339(row["time"]) for row in deleted)
    span = (times[-1] - times[0]).total_seconds()
    print(
        f"\nbacklog of {COUNT}: created in {created_in:.1f}s; reconcile (process) "
        f"{reconcile_in:.1f}s, {runs['listed'] / summary['seconds']['runs']:.0f} runs/s "
        f"planned; drained in {drain_in:.1f}s ({COUNT / drain_in:.0f} deletions/s from "
        f"`lapse up` start, {(COUNT - 1) / max(span, 1e-9):.0f}/s first to last deletion); "
        f"outcomes {dict(outcomes)}"
    )
