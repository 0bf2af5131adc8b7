"""The safety net on the real cluster's Knative path (issue 38): an event lost on the way to
the planner is not a run lost. The planner's Trigger is taken away (as an in-memory
channel's restarting dispatcher loses what it holds, the event reaches no subscriber), a
finished Workflow due at once is created, and the Deployment lapse-policy-watcher's next
periodic pass (lapse.yaml's `reconcile.period`, 15 s here) plans it; the due event goes
NATS -> lapse-bridge -> Broker -> object-reaper as any other, and the Workflow is deleted.
With no Trigger to the planner for the whole test, nothing but the pass could have planned
it; its log line says it planned one run.

Run by `make test-cluster`; lapse is deployed once per session (lapse_on_cluster.py).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_on_cluster import (
    RUNS,
    SYSTEM,
    DeletionWatch,
    Deployment,
    finished_workflow,
    kubectl_waiting,
)

WATCHER = "lapse-policy-watcher"
TRIGGER = "ttl-planner"
PERIOD = 20.0  # reconcile.period + jitter in lapse_on_cluster.lapse_yaml()


def subscription_uids(cluster: Cluster, trigger_uid: str) -> set[str]:
    """The channel Subscriptions the Broker made for a Trigger (owned by it)."""
    items = json.loads(
        cluster.kubectl("-n", SYSTEM, "get", "subscriptions.messaging.knative.dev", "-o", "json")
    )["items"]
    return {
        s["metadata"]["uid"]
        for s in items
        if any(o.get("uid") == trigger_uid for o in s["metadata"].get("ownerReferences", []))
    }


def channel_subscribers(cluster: Cluster) -> set[str]:
    """The Subscriptions the Broker's channels deliver to now (their status)."""
    items = json.loads(
        cluster.kubectl("-n", SYSTEM, "get", "inmemorychannels.messaging.knative.dev", "-o", "json")
    )["items"]
    return {
        s["uid"]
        for c in items
        for s in ((c.get("status") or {}).get("subscribers") or [])
        if s.get("uid")
    }


def as_new(obj: dict[str, Any]) -> dict[str, Any]:
    """The Trigger as it was applied: what `kubectl create` takes back."""
    meta = obj["metadata"]
    keep = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": keep,
            "spec": obj["spec"]}  # fmt: skip


def planned_counts(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"safety net pass: .*?, (\d+) planned,", log)]


def test_a_run_whose_event_was_lost_is_planned_by_the_next_pass_and_deleted(
    lapse: Deployment,
) -> None:
    cluster = lapse.cluster
    kubectl_waiting(cluster, "-n", SYSTEM, "rollout", "status", f"deploy/{WATCHER}", timeout=240)
    trigger = json.loads(cluster.kubectl("-n", SYSTEM, "get", "trigger", TRIGGER, "-o", "json"))
    subscriptions = subscription_uids(cluster, trigger["metadata"]["uid"])
    assert subscriptions, f"no Subscription of Trigger {TRIGGER}"
    name = f"lost-{uuid.uuid4().hex[:8]}"
    watch = DeletionWatch(cluster, RUNS, name)
    cluster.kubectl("-n", SYSTEM, "delete", "trigger", TRIGGER, "--wait=true")
    try:
        poll(
            "the Broker's channel no longer delivers to the planner",
            lambda: not (channel_subscribers(cluster) & subscriptions),
            60,
            0.5,
        )
        time.sleep(1)  # the watch is established (its first list comes back empty)
        since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        finished_at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
        created = json.loads(
            cluster.kubectl(
                "-n", RUNS, "create", "-o", "json", "-f", "-",
                stdin=json.dumps(finished_workflow(name, finished_at, "1m")),
            )
        )  # fmt: skip
        created_at = time.time()
        uid = created["metadata"]["uid"]
        watch.added()
        try:
            # One period (and its jitter) for the pass, then the due path's own latency
            # (bridge, Broker, a reaper that may scale from zero).
            deleted_at = watch.deleted_at(uid, timeout=PERIOD + 90)
        except AssertionError as exc:
            logs = cluster.kubectl("-n", SYSTEM, "logs", f"deploy/{WATCHER}", "--tail=40",
                                   check=False)  # fmt: skip
            raise AssertionError(
                f"{exc}: {name} (uid {uid}), its event lost, was not deleted\n"
                f"--- {WATCHER} logs\n{logs}\n{lapse.diagnosis()}"
            ) from None
        log = cluster.kubectl("-n", SYSTEM, "logs", f"deploy/{WATCHER}", f"--since-time={since}")
        assert any(n >= 1 for n in planned_counts(log)), log[-3000:]
        print(
            f"\nWorkflow {name}, due at once, its event lost (no Trigger to the planner): "
            f"planned by the safety net and deleted {deleted_at - created_at:.1f} s after "
            f"it was created (period {PERIOD:.0f} s with jitter)"
        )
    finally:
        watch.stop()
        cluster.kubectl("-n", SYSTEM, "create", "-f", "-", stdin=json.dumps(as_new(trigger)),
                        check=False)  # fmt: skip
        cluster.kubectl("-n", RUNS, "delete", "workflow", name, "--ignore-not-found", check=False)
        kubectl_waiting(cluster, "-n", SYSTEM, "wait", f"trigger/{TRIGGER}",
                        "--for=condition=Ready", "--timeout=120s", timeout=130)  # fmt: skip
