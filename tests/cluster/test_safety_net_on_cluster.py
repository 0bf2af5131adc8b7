"""The safety net on the real cluster (issue 38): a finished run whose event never reaches
the planner is planned by the periodic reconcile (`lapse.operations.reconcile.periodic`,
docs/deploy.md "The safety net") and deleted at its deadline, not before; a run still
Running beside it is never touched.

The event is lost by construction, and no shared object is touched (re-creating the
Trigger `ttl-planner` left the Broker's filter with the old Trigger's token: docs/deploy.md,
"Installing again in the same namespace within the hour"): the Workflows are written in
UNWATCHED, a namespace lapse cleans (lapse.yaml's safety.namespaces, and the Roles the
overlay makes for a cleaned namespace: lapse_on_cluster.unwatched_namespace) that the
ApiServerSource does not watch. No event of a run there ever reaches the planner.

The deployed watcher passes every 10 minutes (lapse.yaml's default). A short period there
would also plan `default`'s runs, and so hide a Broker path that lost their events from the
other tests (test_pipeline_on_knative's bound is there so a lost event fails rather than
passing late) and race the ttl-planner whose span test_traces_on_cluster looks for. So the
short period is this test's alone: a second safety net, the Deployment
lapse-policy-watcher copied (same image, command, ServiceAccount and NATS identity) with the
deployed lapse.yaml but safety.namespaces UNWATCHED only and a pass every PERIOD seconds,
removed afterwards.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import yaml

from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_on_cluster import (
    SYSTEM,
    UNWATCHED,
    Deployment,
    Written,
    finished_workflow,
    kubectl_waiting,
    rfc3339,
)

WATCHER = "lapse-policy-watcher"
NET = "lapse-safety-net-test"  # the Deployment and ConfigMap of this test's safety net
PERIOD, JITTER = 10, 1  # seconds
TTL = 15  # longer than a period and its jitter: the pass comes before the deadline
PASS = re.compile(r"safety net pass: (\d+) finished runs seen in (\d+) scopes, (\d+) planned")


def scoped_safety_net(cluster: Cluster) -> list[dict[str, Any]]:
    """The deployed watcher, copied: its lapse.yaml cleaning UNWATCHED only, a short period."""
    config = yaml.safe_load(cluster.get(SYSTEM, "configmap/lapse")["data"]["lapse.yaml"])
    assert UNWATCHED in config["safety"]["namespaces"]["include"], config["safety"]
    config["safety"]["namespaces"] = {"include": [UNWATCHED]}
    config["reconcile"] = {"enabled": True, "period": f"{PERIOD}s", "jitter": f"{JITTER}s"}
    spec = cluster.get(SYSTEM, f"deploy/{WATCHER}")["spec"]
    mark = {"lapse.dev/test": "safety-net"}  # its pods apart from the deployed watcher's
    spec["selector"]["matchLabels"].update(mark)
    spec["template"]["metadata"]["labels"].update(mark)
    volumes = [v for v in spec["template"]["spec"]["volumes"]
               if v.get("configMap", {}).get("name") == "lapse"]  # fmt: skip
    assert len(volumes) == 1, spec["template"]["spec"]["volumes"]
    volumes[0]["configMap"]["name"] = NET
    metadata = {"name": NET, "namespace": SYSTEM, "labels": {"app.kubernetes.io/part-of": "lapse"}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
         "data": {"lapse.yaml": yaml.safe_dump(config, sort_keys=False)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec},
    ]  # fmt: skip


def passes(cluster: Cluster) -> list[tuple[int, int]]:
    """(finished runs listed, planned) of each pass this test's safety net made, in order."""
    logs = cluster.kubectl("-n", SYSTEM, "logs", f"deploy/{NET}", check=False)
    found = [PASS.search(line) for line in logs.splitlines()]
    return [(int(m[1]), int(m[3])) for m in found if m]


def running_workflow(name: str) -> dict[str, Any]:
    """A Workflow Argo's controller is still running: no completed label, no finishedAt."""
    workflow = finished_workflow(name, datetime.now(UTC), f"{TTL}s")
    workflow["metadata"]["labels"] = {}
    workflow["status"] = {"phase": "Running", "startedAt": workflow["status"]["startedAt"]}
    return workflow


def test_a_run_whose_event_never_came_is_deleted_by_the_safety_net_at_its_deadline(
    lapse: Deployment,
) -> None:
    cluster = lapse.cluster
    # Lost by construction: the ApiServerSource lists namespaces by name, UNWATCHED not.
    source = cluster.get(SYSTEM, "apiserversource/lapse-workflows")["spec"]
    watched = source["namespaceSelector"]["matchExpressions"][0]["values"]
    assert UNWATCHED not in watched and watched, source["namespaceSelector"]

    manifests = {"apiVersion": "v1", "kind": "List", "items": scoped_safety_net(cluster)}
    running = f"running-{uuid.uuid4().hex[:8]}"
    got: Written | None = None
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifests))
        kubectl_waiting(cluster, "-n", SYSTEM, "rollout", "status", f"deploy/{NET}", timeout=120)
        poll("the safety net's first pass", lambda: passes(cluster), timeout=60, interval=0.5)

        created = json.loads(cluster.kubectl(
            "-n", UNWATCHED, "create", "-o", "json", "-f", "-",
            stdin=json.dumps(running_workflow(running)),
        ))  # fmt: skip
        before = len(passes(cluster))
        got = Written(lapse, TTL, "lost", namespace=UNWATCHED)
        got.write()
        written = time.time()
        # Found by a pass within a period (and its jitter) of being written: before the
        # deadline, so the run is deleted on time.
        planned_at: float = poll(
            "a pass of the safety net planned the run",
            lambda: any(planned for _, planned in passes(cluster)[before:]) and time.time(),
            timeout=PERIOD + JITTER + 10,
            interval=0.5,
        )
        assert planned_at - written < PERIOD + JITTER + 3, planned_at - written
        assert planned_at < got.deadline, got
        # `lapse status`, in the safety net's pod (its NATS identity): the run's schedule
        # in NATS at its deadline, and the pass that planned it.
        status = json.loads(cluster.kubectl(
            "-n", SYSTEM, "exec", f"deploy/{NET}", "--",
            "python", "-m", "lapse.cli", "status", "-o", "json",
        ))  # fmt: skip
        deadline = rfc3339(datetime.fromtimestamp(got.deadline, UTC))
        pending = status["pending"]["kubernetes"]["next"]
        assert any(got.name in p["run"] and p["deadline"] == deadline for p in pending), (
            deadline, pending)  # fmt: skip
        pod = cluster.kubectl("-n", SYSTEM, "get", "pods", "-l", "lapse.dev/test=safety-net",
                              "-o", "jsonpath={.items[0].metadata.name}")  # fmt: skip
        (net,) = [n for n in status["safetyNet"] if n["process"].startswith(pod)]
        assert (net["ok"], net["problems"], net["planned"]) == (True, [], 1), net
        got.deleted()  # not before its deadline, and within 120 s after it
        # One more pass after the deletion: it plans nothing, and lists nothing (the
        # Running run is no finished run) unless it listed just before the deletion.
        done = len(passes(cluster))
        poll("a pass after the deletion", lambda: len(passes(cluster)) > done,
             timeout=PERIOD + JITTER + 10, interval=0.5)  # fmt: skip
        after = passes(cluster)[before:]
        seconds = time.time() - written
        assert after[-1][1] == 0, after

        # Planned by this safety net, one pass each period: the finished run alone.
        assert sum(planned for _, planned in after) == 1, after
        assert all(listed <= 1 for listed, _ in after), after
        # After the deadline only the reaper's own latency, a cold start included: the
        # bound of test_pipeline_on_knative's Broker path.
        assert got.lateness < 60, got
        # The Running Workflow, beside it through every pass: never listed, never written.
        still = cluster.get(UNWATCHED, f"workflow/{running}")["metadata"]
        assert (still["uid"], still["resourceVersion"]) == (
            created["metadata"]["uid"], created["metadata"]["resourceVersion"])  # fmt: skip
        print(
            f"\nWorkflow {got.name} in {UNWATCHED} (no event): planned by the safety net "
            f"{planned_at - written:.1f} s after it was written (a pass every {PERIOD}+"
            f"{JITTER} s), deleted {got.lateness:.2f} s after its "
            f"deadline; {len(after)} passes in {seconds:.0f} s, {after} (listed, planned); "
            f"Running {running} untouched; lapse status after the planning pass: {net}, "
            f"pending {pending}"
        )
    finally:
        cluster.kubectl("-n", SYSTEM, "delete", "deploy,configmap", NET, "--ignore-not-found",
                        "--wait=false", check=False)  # fmt: skip
        # The finished one too, when the test failed before lapse deleted it.
        left = [running, *([got.name] if got is not None and got.name else [])]
        cluster.kubectl("-n", UNWATCHED, "delete", "workflow", *left, "--ignore-not-found",
                        "--wait=false", check=False)  # fmt: skip
