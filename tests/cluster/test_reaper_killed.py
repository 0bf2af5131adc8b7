"""An object-reaper killed mid-work loses nothing (issue 17): a batch of Workflows due in the
same second; as soon as the first is deleted, the function container of every
object-reaper pod is killed with SIGKILL (what the kernel's OOM killer does: no shutdown,
its in-flight requests cut off; the kubelet restarts it). Every Workflow must still be
deleted, none before its deadline: the Broker redelivers what the dead process never
answered (infra/knative/delivery.yaml).

Not `kubectl delete pod --grace-period=0 --force`: on this cluster (Serving v0.50.0) that
left the activator with no backend for the revision although the new pod was Ready (it
probed the private Service's ClusterIP and got 404 every 200 ms), so the redelivered
events waited in the activator until it was restarted (docs/cluster.md)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.cluster.conftest import Cluster, json_objects, poll
from tests.cluster.lapse_on_cluster import (
    REAPER,
    RUNS,
    SYSTEM,
    DeletionWatch,
    Deployment,
    finished_workflow,
)

# safety.max_deletions_per_second is 5 in the dev overlay: the batch takes about 6 s, so
# the kill lands while most of it is still to do.
BATCH = 30
TTL = 25


def function_restarts(pod: dict[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return sum(int(c.get("restartCount", 0)) for c in statuses if c["name"] == "function")


def kill_function_container(cluster: Cluster, pod: dict[str, Any]) -> None:
    """SIGKILL to the function container's process, through containerd (the node is this
    machine)."""
    (status,) = [c for c in pod["status"]["containerStatuses"] if c["name"] == "function"]
    container = status["containerID"].removeprefix("containerd://")
    result = subprocess.run(
        ["ctr", "--address", cluster.containerd_sock, "-n", "k8s.io", "tasks", "kill",
         "--signal", "SIGKILL", container],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, f"ctr tasks kill {container}: {result.stderr}"


def test_an_object_reaper_pod_killed_mid_work_loses_nothing(lapse: Deployment) -> None:
    cluster = lapse.cluster
    batch = uuid.uuid4().hex[:8]
    watch = DeletionWatch(cluster, RUNS, selector=f"lapse-test-batch={batch}")
    try:
        time.sleep(1)  # the watch is established
        finished_at = datetime.now(UTC).replace(microsecond=0)
        deadline = (finished_at + timedelta(seconds=TTL)).timestamp()
        workflows = [
            finished_workflow(
                f"killed-{batch}-{i:02d}", finished_at, f"{TTL}s",
                labels={"lapse-test-batch": batch},
            )
            for i in range(BATCH)
        ]  # fmt: skip
        created = json_objects(
            cluster.kubectl(
                "-n", RUNS, "create", "-o", "json", "-f", "-",
                stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": workflows}),
            )
        )  # fmt: skip
        uids = {item["metadata"]["uid"] for item in created}
        assert len(uids) == BATCH

        while time.time() < deadline - 1:
            assert not watch.deleted(), "a Workflow deleted before its deadline"
            time.sleep(0.2)
        poll("the first deletion", lambda: watch.deleted(), timeout=120, interval=0.02)
        pods = lapse.pods(REAPER)
        assert pods, f"no {REAPER} pod while it deletes"
        killed_at = time.time()
        for pod in pods:
            kill_function_container(cluster, pod)
        done_when_killed = len([t for t in watch.deleted().values() if t <= killed_at])
        assert done_when_killed < BATCH, "the batch was done before the kill: nothing proven"

        try:
            poll(
                "every Workflow of the batch deleted",
                lambda: uids <= set(watch.deleted()),
                timeout=300,
                interval=0.2,
            )
        except AssertionError as exc:
            left = cluster.kubectl(
                "-n", RUNS, "get", "workflows", "-l", f"lapse-test-batch={batch}", "-o", "name"
            )  # fmt: skip
            raise AssertionError(f"{exc}: still there:\n{left}\n{lapse.diagnosis()}") from None
        deleted = watch.deleted()
    finally:
        watch.stop()
    early = [uid for uid in uids if deleted[uid] < deadline]
    assert not early, f"{len(early)} deleted before the deadline"
    last = max(deleted[uid] for uid in uids)
    # The kill was real: the kubelet restarted each killed container.
    names = [p["metadata"]["name"] for p in pods]
    restarts = {name: function_restarts(cluster.get(SYSTEM, f"pod/{name}")) for name in names}
    assert all(n >= 1 for n in restarts.values()), restarts
    print(
        f"\n{BATCH} Workflows due at once; {done_when_killed} deleted when the object-reaper "
        f"function(s) in {', '.join(names)} were killed ({killed_at - deadline:.2f} s after the "
        f"deadline); the other {BATCH - done_when_killed} deleted by "
        f"{last - killed_at:.1f} s after the kill (last {last - deadline:.1f} s after the "
        f"deadline); container restarts {restarts}"
    )
