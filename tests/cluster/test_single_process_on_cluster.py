"""The single-process overlay on the real cluster: `lapse up` and its NATS admitted under Pod
Security `restricted` and Ready, as UID 65532 on a read-only root; and the NATS keeps its
data on a PersistentVolumeClaim (infra/overlays/single-process/nats-data.yaml): a pending
deletion deadline (a JetStream message schedule) survives the NATS pod being deleted. On
an emptyDir, as before, the new pod started with no streams at all.

The test cluster has no storage provisioner (scripts/cluster/ starts none), so the test
makes the PersistentVolume a provisioner would: a hostPath folder on the node, bound to the
overlay's claim. The overlay's NATS objects (its claim, Deployment, Service and
configuration) and `lapse up` (its Deployment, Service, ServiceAccount and read-only
cluster-wide watch, renamed for the namespace, cleaning only that namespace) run in a
scratch namespace that enforces Pod Security `restricted`, beside the dev overlay the other
tests use; the password and ingress-token Secrets are made here."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from lapse.edges.schedules import schedule_headers
from lapse.embedded.nats_identities import ADMIN, KUBERNETES, USERS_SECRET, inbox_prefix
from tests.cluster.conftest import REPO, Cluster, poll
from tests.cluster.lapse_on_cluster import Deployment, kubectl_waiting
from tests.infra_package import rendered

PV_ROOT = Path("/var/lib/lapse-test-volumes")
UID = 65532


@pytest.fixture
def volume_dir() -> Iterator[Path]:
    folder = PV_ROOT / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    # A provisioner's volume belongs to the pod's fsGroup; a hostPath gets no such change,
    # so it is made the NATS user's here.
    os.chown(folder, UID, UID)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def nats_objects(namespace: str, images: dict[str, str]) -> list[dict[str, Any]]:
    """The dev NATS of the single-process overlay, as rendered, moved to `namespace`, its
    image the one pushed to the cluster's registry (as `lapse` deployed it)."""
    wanted = {("PersistentVolumeClaim", "nats-data"), ("Deployment", "nats"), ("Service", "nats")}
    objects = []
    for doc in rendered("single-process"):
        name = doc["metadata"]["name"]
        if (doc["kind"], name) in wanted or name.startswith("lapse-nats-conf"):
            doc["metadata"]["namespace"] = namespace
            if doc["kind"] == "Deployment":
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    container["image"] = images[container["image"].rsplit(":", 1)[0]]
            objects.append(doc)
    assert len(objects) == 4, [o["metadata"]["name"] for o in objects]
    return objects


def lapse_up_objects(namespace: str, images: dict[str, str]) -> list[dict[str, Any]]:
    """`lapse up` of the single-process overlay, as rendered, in `namespace` (with the
    ConfigMaps it reads): its NATS there, cleaning only there, its cluster-scoped watch
    named for the namespace."""
    objects = []
    for doc in rendered("single-process"):
        kind, name = doc["kind"], doc["metadata"]["name"]
        if (
            name == "lapse" and kind in ("ServiceAccount", "Deployment", "Service", "ConfigMap")
        ) or (name == "lapse-telemetry"):
            doc["metadata"]["namespace"] = namespace
            objects.append(doc)
        elif name == "lapse-watch" and kind in ("ClusterRole", "ClusterRoleBinding"):
            doc["metadata"]["name"] = f"lapse-watch-{namespace}"
            objects.append(doc)
        else:
            continue
        if kind == "ConfigMap" and name == "lapse":
            doc["data"]["nats-url"] = f"nats://nats.{namespace}.svc:4222"
            config = yaml.safe_load(doc["data"]["lapse.yaml"])
            config["safety"]["namespaces"]["include"] = [namespace]
            doc["data"]["lapse.yaml"] = yaml.safe_dump(config)
        elif kind == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                container["image"] = images[container["image"].rsplit(":", 1)[0]]
        elif kind == "ClusterRoleBinding":
            doc["roleRef"]["name"] = f"lapse-watch-{namespace}"
            doc["subjects"][0]["namespace"] = namespace
    assert len(objects) == 7, [(o["kind"], o["metadata"]["name"]) for o in objects]
    return objects


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
    cluster: Cluster, lapse: Deployment, namespace: str, volume_dir: Path, tmp_path: Path
) -> None:
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    passwords = {i.user: secrets.token_hex(16) for i in KUBERNETES}
    secret = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": USERS_SECRET, "namespace": namespace}, "stringData": passwords,
    }  # fmt: skip
    volume = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": f"lapse-nats-{namespace}"},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
            "hostPath": {"path": str(volume_dir), "type": "Directory"},
            "claimRef": {"namespace": namespace, "name": "nats-data"},
        },
    }  # fmt: skip
    ingress = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "lapse-ingress", "namespace": namespace},
        "stringData": {"token": secrets.token_hex(32)},
    }  # fmt: skip
    items = [
        secret, ingress, volume,
        *nats_objects(namespace, lapse.images), *lapse_up_objects(namespace, lapse.images),
    ]  # fmt: skip
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": items}))  # fmt: skip
    try:
        kubectl_waiting(cluster, "-n", namespace, "rollout", "status", "deploy/nats",
                        timeout=180)  # fmt: skip
        claim = cluster.get(namespace, "pvc/nats-data")
        assert claim["status"]["phase"] == "Bound", claim["status"]
        ip = cluster.get(namespace, "service/nats")["spec"]["clusterIP"]
        url = f"nats://{ip}:4222"

        # The streams, by lapse's own command, as the lapse-streams pod makes them.
        (tmp_path / "password").write_text(passwords[ADMIN.user])
        (tmp_path / "lapse.yaml").write_text(yaml.safe_dump({"nats": {"replicas": 1}}))
        env = {
            **os.environ, "PYTHONPATH": str(REPO), "LAPSE_CONFIG": str(tmp_path / "lapse.yaml"),
            "LAPSE_NATS__URL": url, "LAPSE_NATS__USER": ADMIN.user,
            "LAPSE_NATS__PASSWORD_FILE": str(tmp_path / "password"),
        }  # fmt: skip
        applied = subprocess.run(
            [sys.executable, "-m", "lapse.cli", "infra", "apply"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        # `lapse up`: admitted, Ready (its NATS, its watch and its functions up), as 65532.
        kubectl_waiting(cluster, "-n", namespace, "rollout", "status", "deploy/lapse",
                        timeout=240)  # fmt: skip
        uid = cluster.kubectl("-n", namespace, "exec", "deploy/lapse", "--", "id", "-u")
        assert uid.strip() == str(UID)
        subject = f"test.{uuid.uuid4().hex[:8]}"
        body = b'{"run": "survives-a-restart"}'
        seq = asyncio.run(_schedule(url, passwords[ADMIN.user], subject, body))
        assert asyncio.run(_stored(url, passwords[ADMIN.user], subject)) == body

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
        assert asyncio.run(_stored(url, passwords[ADMIN.user], subject)) == body
        print(f"\nschedule #{seq} survived deleting NATS pod {first} (volume {volume_dir})")
    finally:
        cluster.kubectl("-n", namespace, "delete", "deploy", "nats", "lapse", "--wait=true",
                        check=False)  # fmt: skip
        cluster.kubectl("-n", namespace, "delete", "pvc", "nats-data", "--wait=false", check=False)
        cluster.kubectl("delete", "pv", f"lapse-nats-{namespace}", "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", f"lapse-watch-{namespace}",
                        "--wait=false", check=False)  # fmt: skip
