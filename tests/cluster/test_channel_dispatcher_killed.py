"""The Broker's channel dispatcher killed mid-burst loses nothing (issue 38): a batch of
Workflows due in the same second; at the first deletion, with the channel provably holding
events (its JetStream consumer's pending and unacknowledged counts, read from the channel's
own nats-server), the dispatcher of the Broker's channel (Knative's NATS JetStream channel,
infra/components/natss-channel) is killed with SIGKILL, and once it is back, the
object-reaper's function. Every Workflow must be deleted, none before its deadline, and
none DELETEd twice, counted at the API server (its audit log, scripts/cluster/start.sh).

What a due event crosses: lapse-bridge -> the Broker's ingress -> the channel -> its
dispatcher -> the Broker's filter -> object-reaper. The bridge acks the due message to NATS
once the ingress accepted the event; from then on only the channel holds it. The JetStream
channel acks its own copy only after the filter answered, so the events the dead dispatcher
was delivering are redelivered (after the consumer's ack wait, 30 s). What keeps events in
the channel at the kill, by design rather than by luck: the dev overlay's deletion rate (5/s)
holds each delivery in the object-reaper until its turn, so a batch of 40 takes about 8 s
and the first deletion leaves the rest unacknowledged in the channel.

Runs on the natss channel, the test cluster's default (LAPSE_CLUSTER_CHANNEL=in-memory
skips it: the in-memory channel keeps nothing across a restart, and in the one run there,
2026-11-28, it lost nothing all the same, so the test cannot show that loss reliably)."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.report import parse_audit_line
from tests.cluster.conftest import Cluster, json_objects, poll
from tests.cluster.lapse_on_cluster import (
    CHANNEL,
    REAPER,
    RUNS,
    SYSTEM,
    DeletionWatch,
    Deployment,
    container_restarts,
    finished_workflow,
    kill_container,
)

pytestmark = pytest.mark.skipif(
    CHANNEL != "natss",
    reason="the Broker is on the in-memory channel (LAPSE_CLUSTER_CHANNEL=in-memory), which "
    "keeps nothing across a dispatcher restart",
)
EVENTING = "knative-eventing"
DISPATCHER = (
    "messaging.knative.dev/channel=nats-jetstream-channel,messaging.knative.dev/role=dispatcher"
)
# The channel's own nats-server (scripts/cluster/manifests/natss-jetstream.yaml), its
# monitoring port read through the API server's pod proxy.
CHANNEL_NATS = "app.kubernetes.io/name=natss-jetstream"
# 5 deletions/s in the dev overlay: the batch takes 8 s, so both kills land mid-burst.
BATCH = 40
TTL = 20


def running_pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json")
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return [p for p in items if "deletionTimestamp" not in p["metadata"]]


def ready(pod: dict[str, Any], container: str) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return any(c["name"] == container and c.get("ready") for c in statuses)


def held_by_the_channel(cluster: Cluster) -> dict[str, int]:
    """Per JetStream consumer of the lapse Broker's channel: the events it holds that the
    Broker's filter has not answered yet (not yet delivered + delivered, unacknowledged)."""
    (pod,) = running_pods(cluster, EVENTING, CHANNEL_NATS)
    jsz = json.loads(
        cluster.kubectl(
            "get", "--raw",
            f"/api/v1/namespaces/{EVENTING}/pods/{pod['metadata']['name']}:8222/proxy/"
            "jsz?accounts=true&streams=true&consumers=true",
        )
    )  # fmt: skip
    held: dict[str, int] = {}
    for account in jsz.get("account_details", []):
        for stream in account.get("stream_detail", []):
            if f"KN_{SYSTEM.upper().replace('-', '_')}__" not in stream["name"]:
                continue  # another namespace's channel
            for consumer in stream.get("consumer_detail", []):
                held[f"{stream['name']}/{consumer['name']}"] = (
                    consumer["num_pending"] + consumer["num_ack_pending"]
                )
    return held


def deletes_at_the_api_server(cluster: Cluster, names: set[str]) -> Counter[str]:
    """How many DELETE requests the API server answered for each of `names` in RUNS."""
    counts: Counter[str] = Counter()
    for line in Path(cluster.audit_log).read_text().splitlines():
        request = parse_audit_line(line)
        if (
            request is not None
            and request.verb == "delete"
            and request.namespace == RUNS
            and request.name in names
        ):
            counts[request.name] += 1
    return counts


def test_the_channel_dispatcher_killed_mid_burst_loses_nothing(lapse: Deployment) -> None:
    cluster = lapse.cluster
    assert cluster.audit_log and Path(cluster.audit_log).exists(), "no audit log (start.sh)"
    batch = uuid.uuid4().hex[:8]
    watch = DeletionWatch(cluster, RUNS, selector=f"lapse-test-batch={batch}")
    try:
        time.sleep(1)  # the watch is established
        finished_at = datetime.now(UTC).replace(microsecond=0)
        deadline = (finished_at + timedelta(seconds=TTL)).timestamp()
        workflows = [
            finished_workflow(
                f"dispatcher-{batch}-{i:02d}", finished_at, f"{TTL}s",
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
        names = {item["metadata"]["name"] for item in created}
        assert len(uids) == BATCH

        while time.time() < deadline - 1:
            assert not watch.deleted(), "a Workflow deleted before its deadline"
            time.sleep(0.2)
        poll("the first deletion", lambda: watch.deleted(), timeout=120, interval=0.02)
        held = held_by_the_channel(cluster)
        assert held, "no JetStream consumer of the lapse Broker's channel"
        assert sum(held.values()) > 0, f"the channel held nothing at the kill: {held}"
        dispatchers = running_pods(cluster, EVENTING, DISPATCHER)
        assert dispatchers, f"no channel dispatcher ({DISPATCHER}) while the burst is delivered"
        dispatcher_killed_at = time.time()
        for pod in dispatchers:
            kill_container(cluster, pod, "dispatcher")
        done_at_first_kill = len(watch.deleted())
        assert done_at_first_kill < BATCH, "the batch was done before the kill: nothing proven"

        # Then, with the dispatcher back, the reaper: the events it was given die with it.
        def dispatchers_back() -> bool:
            pods = running_pods(cluster, EVENTING, DISPATCHER)
            return bool(pods) and all(
                container_restarts(p, "dispatcher") >= 1 and ready(p, "dispatcher")
                for p in pods
                if p["metadata"]["name"] in {d["metadata"]["name"] for d in dispatchers}
            )

        poll("the dispatcher restarted and Ready", dispatchers_back, timeout=60, interval=0.2)
        reapers = lapse.pods(REAPER)
        reaper_killed_at = time.time()
        for pod in reapers:
            kill_container(cluster, pod, "function")
        done_at_second_kill = len(watch.deleted())

        try:
            poll(
                "every Workflow of the batch deleted",
                lambda: uids <= set(watch.deleted()),
                timeout=120,
                interval=0.2,
            )
        except AssertionError as exc:
            left = cluster.kubectl(
                "-n", RUNS, "get", "workflows", "-l", f"lapse-test-batch={batch}", "-o", "name"
            )  # fmt: skip
            raise AssertionError(
                f"{exc} ({CHANNEL} channel): {len(uids - set(watch.deleted()))} of {BATCH} "
                f"lost; still there:\n{left}\n{lapse.diagnosis()}"
            ) from None
        deleted = watch.deleted()
    finally:
        watch.stop()
    early = [uid for uid in uids if deleted[uid] < deadline]
    assert not early, f"{len(early)} deleted before the deadline"
    # Each DELETE is in the audit log once it completed; the watch saw them all complete.
    deletes = poll(
        "every deletion in the audit log",
        lambda: (c := deletes_at_the_api_server(cluster, names)) and sum(c.values()) >= BATCH and c,
        timeout=10,
        interval=0.2,
    )
    assert set(deletes) == names, sorted(names - set(deletes))
    twice = {name: n for name, n in deletes.items() if n > 1}
    assert not twice, f"DELETEd more than once: {twice}"
    last = max(deleted[uid] for uid in uids)
    print(
        f"\n{CHANNEL} channel, {BATCH} Workflows due at once: the dispatcher killed "
        f"{dispatcher_killed_at - deadline:.2f} s after the deadline ({done_at_first_kill} "
        f"deleted, {sum(held.values())} events held by the channel), the object-reaper "
        f"{reaper_killed_at - deadline:.2f} s after it "
        f"({done_at_second_kill} deleted); the last deleted {last - deadline:.1f} s after "
        f"the deadline; 0 early, 0 lost, {sum(deletes.values())} DELETEs at the API server"
    )
