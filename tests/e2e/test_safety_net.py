"""The safety net of the Knative shape, as its Deployment runs it (`python -m
lapse.operations.reconcile.periodic`, the lapse-policy-watcher pod's command) on real NATS
and kube-apiserver, with `lapse up --no-watch` as the reapers: a finished run whose event
was lost (nothing plans it: no watcher, no event) is planned by the next pass and deleted
by lapse's own reaper; a run planned under a policy lapse.yaml no longer has (a stale
deadline a day away) is moved by the pass and deleted too. `lapse status` shows the pass."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from lapse.config import Streams, load_config
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import parse_payload
from lapse.events.models import CleanupCompleted
from lapse.events.run import Target
from lapse.events.types import EventType, Outcome
from lapse.operations.audit import audit_events
from lapse.operations.reconcile import Options, reconcile
from lapse.runtime.resources import Resources
from tests.conftest import KubeStack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow


def lapse_yaml(path: Path, nats_url: str, kube: KubeStack, namespace: str, ttl: str) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"safety: {{max_deletions_per_second: 200, namespaces: {{include: ['{namespace}']}}}}\n"
        f"policies: [{{name: ttl-{ttl}, kubernetes: {{ttl: {ttl}}}}}]\n"
        # A short period, as a test can afford; the default is 10m (docs/deploy.md).
        "reconcile: {period: 2s, jitter: 1s}\n"
    )
    return path


async def test_a_run_whose_event_was_lost_and_a_stale_deadline_are_deleted_within_a_period(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    ns = kube.namespace(f"net-{uuid.uuid4().hex[:6]}")
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    lost = await kube.workflows.create(
        ns, argo_workflow("lost", namespace=ns, finished_at=finished)
    )
    stale = await kube.workflows.create(
        ns, argo_workflow("stale", namespace=ns, finished_at=finished)
    )
    config = lapse_yaml(tmp_path / "lapse.yaml", own_nats.url, kube, ns, "1m")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    up.args.append("--no-watch")  # the reapers and the due path; nothing that finds runs
    await up.start()
    watcher: subprocess.Popen[bytes] | None = None
    nc = await connect(own_nats.url)
    try:
        # "stale" was planned while lapse.yaml said 1d (`lapse reconcile`'s runs pass, as
        # an operator runs it); then the policy became 1m, and nothing on Knative re-plans
        # a run for a lapse.yaml change: its deadline is a day away.
        old = load_config(lapse_yaml(tmp_path / "old.yaml", own_nats.url, kube, ns, "1d"))
        async with Resources(old) as resources:
            summary = await reconcile(resources, Options(namespace=ns, rows=False))
        assert summary.runs is not None and summary.runs.scheduled == 2
        store = NatsScheduleStore(nc.jetstream(), Streams())
        # The lost run's event: gone. Its schedule is withdrawn, as if it had never been made.
        assert await store.cancel(Target.KUBERNETES, lost["metadata"]["uid"])
        pending = await store.get(Target.KUBERNETES, stale["metadata"]["uid"])
        assert pending is not None and pending.deadline == finished + timedelta(days=1)
        ready = tmp_path / "ready"
        env = {**os.environ, "LAPSE_CONFIG": str(config), "LAPSE_READY_FILE": str(ready)}
        log = tmp_path / "watcher.log"
        with log.open("wb") as out:
            # Popen returns at once; the waits below are bounded polls.
            watcher = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "lapse.operations.reconcile.periodic"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        # Nothing planned the lost run while `lapse up` ran without the net.
        assert await store.get(Target.KUBERNETES, lost["metadata"]["uid"]) is None

        async def started() -> bool:
            assert watcher.poll() is None, log.read_text()
            return ready.exists()

        await wait_for(started, timeout=30)

        async def both_gone() -> bool:
            assert watcher.poll() is None, log.read_text()
            return all([await kube.workflows.get(ns, n) is None for n in ("lost", "stale")])

        await wait_for(both_gone, timeout=20)
        # Deleted by lapse's reaper, at the deadline of lapse.yaml's policy now.
        done = [
            parse_payload(e, CleanupCompleted)
            async for e in audit_events(
                nc.jetstream(), Streams().audit, event_type=EventType.CLEANUP_COMPLETED
            )
        ]
        deleted = {d.run.name: str(d.detail) for d in done if d.outcome is Outcome.DELETED}
        assert set(deleted) == {"lost", "stale"}, done
        assert all("ttl-1m" in detail for detail in deleted.values()), deleted

        # `lapse status` shows the last pass: when, and what it found.
        status: dict[str, Any] = lapse_json("status", config=config)
        (net,) = status["safetyNet"]
        assert net["ok"] is True and net["problems"] == [], net
        assert net["secondsAgo"] < 30, net
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0, log.read_text()
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait()
        await nc.close()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
    output = log.read_text()
    assert "policy watcher running" in output, output
    # The pass that found them: one planned (its event lost), one repaired (stale).
    passes = [line for line in output.splitlines() if "safety net pass:" in line]
    assert any("1 planned, 1 repaired" in line for line in passes), passes
