"""The single-process overlay on the real cluster: `lapse up` and its NATS admitted under Pod
Security `restricted` and Ready, as UID 65532 on a read-only root; and the NATS keeps its
data on a PersistentVolumeClaim (infra/overlays/single-process/nats-data.yaml): a pending
deletion deadline (a JetStream message schedule) survives the NATS pod being deleted. On
an emptyDir, as before, the new pod started with no streams at all.

How `lapse up` is deployed there (a scratch restricted namespace, a hostPath volume bound to
the overlay's claim): lapse_up_on_cluster.py, the session's `lapse_up` fixture."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import nats

from lapse.edges.schedules import schedule_headers
from lapse.embedded.nats_identities import ADMIN, inbox_prefix
from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_up_on_cluster import UID, LapseUp


def nats_pod(cluster: Cluster, namespace: str) -> dict[str, Any]:
    pods = [
        p
        for p in cluster.get(namespace, "pods")["items"]
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "nats"
        and "deletionTimestamp" not in p["metadata"]
    ]
    (pod,) = pods
    found: dict[str, Any] = pod
    return found


async def _schedule(url: str, password: str, subject: str, body: bytes) -> int:
    client = await nats.connect(
        url, user=ADMIN.user, password=password, inbox_prefix=inbox_prefix(ADMIN.user)
    )
    try:
        # A deadline a day away, with the headers the planner puts (lapse/edges/schedules.py).
        deadline = datetime.now(UTC) + timedelta(days=1)
        ack = await client.jetstream().publish(
            f"lapse.sched.{subject}",
            body,
            headers=schedule_headers(deadline, f"lapse.due.{subject}"),
        )
        return int(ack.seq)
    finally:
        await client.close()


async def _stored(url: str, password: str, subject: str) -> bytes | None:
    client = await nats.connect(
        url, user=ADMIN.user, password=password, inbox_prefix=inbox_prefix(ADMIN.user)
    )
    try:
        msg = await client.jetstream().get_last_msg("LAPSE_SCHED", f"lapse.sched.{subject}")
        return bytes(msg.data or b"")
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await client.close()


def test_lapse_up_runs_restricted_and_a_pending_schedule_survives_the_nats_pod(
    cluster: Cluster, lapse_up: LapseUp
) -> None:
    namespace, url, password = lapse_up.namespace, lapse_up.nats_url, lapse_up.admin_password
    labels = json.loads(cluster.kubectl("get", "namespace", namespace, "-o", "json"))["metadata"][
        "labels"
    ]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
    claim = cluster.get(namespace, "pvc/nats-data")
    assert claim["status"]["phase"] == "Bound", claim["status"]
    # `lapse up`, admitted and Ready (the fixture waited), runs as 65532.
    uid = cluster.kubectl("-n", namespace, "exec", "deploy/lapse", "--", "id", "-u")
    assert uid.strip() == str(UID)
    subject = f"test.{uuid.uuid4().hex[:8]}"
    body = b'{"run": "survives-a-restart"}'
    seq = asyncio.run(_schedule(url, password, subject, body))
    assert asyncio.run(_stored(url, password, subject)) == body

    first = nats_pod(cluster, namespace)["metadata"]["name"]
    cluster.kubectl("-n", namespace, "delete", "pod", first, "--wait=true")
    poll(
        "a new NATS pod Ready",
        lambda: (
            (pod := nats_pod(cluster, namespace))["metadata"]["name"] != first
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pod["status"].get("conditions", [])
            )
        ),
        timeout=180,
    )
    # Still there, with the sequence it had: the same stream, not a new one.
    assert asyncio.run(_stored(url, password, subject)) == body
    print(f"\nschedule #{seq} survived deleting NATS pod {first} (volume {lapse_up.volume_dir})")
