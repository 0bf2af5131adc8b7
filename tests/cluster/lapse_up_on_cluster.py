"""`lapse up` of the single-process overlay deployed on the real cluster, once per session
(the `lapse_up` fixture of conftest.py), beside the dev overlay the `lapse` fixture deploys.

The overlay's NATS objects (its claim, Deployment, Service and configuration) and `lapse
up` (its Deployment, Service, ServiceAccount, read-only cluster-wide watch and the deleting
Role of the namespace it cleans, renamed for the namespace) run in a scratch namespace that
enforces Pod Security `restricted` and that `lapse up` cleans; the password and
ingress-token Secrets are made here, the streams by `lapse infra apply` from the host.

The test cluster has no storage provisioner (scripts/cluster/ starts none), so this makes
the PersistentVolume a provisioner would: a hostPath folder on the node, bound to the
overlay's claim."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lapse.embedded.nats_identities import ADMIN, KUBERNETES, USERS_SECRET
from tests.cluster.conftest import REPO, Cluster
from tests.cluster.lapse_on_cluster import kubectl_waiting
from tests.infra_package import rendered

PV_ROOT = Path("/var/lib/lapse-test-volumes")
UID = 65532


@dataclass(frozen=True)
class LapseUp:
    namespace: str  # where `lapse up` and its NATS run, and the one namespace it cleans
    nats_url: str  # the NATS Service's ClusterIP (the host reaches ClusterIPs)
    admin_password: str
    volume_dir: Path  # the NATS data's hostPath
    config: Path  # a lapse.yaml for lapse's commands run from the host (`history`)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`lapse <args>` on the host, against this deployment's NATS as its admin."""
        password = self.config.parent / "password"
        env = {
            **os.environ, "PYTHONPATH": str(REPO), "LAPSE_CONFIG": str(self.config),
            "LAPSE_NATS__URL": self.nats_url, "LAPSE_NATS__USER": ADMIN.user,
            "LAPSE_NATS__PASSWORD_FILE": str(password),
        }  # fmt: skip
        return subprocess.run(
            [sys.executable, "-m", "lapse.cli", *args],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip


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
    ConfigMaps it reads): its NATS there, cleaning only there (the overlay's deleting Role
    and RoleBinding of `default`, moved there), its cluster-scoped watch named for the
    namespace."""
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
        elif kind in ("Role", "RoleBinding") and doc["metadata"].get("namespace") == "default":
            doc["metadata"]["namespace"] = namespace
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
        elif kind == "RoleBinding":
            doc["subjects"][0]["namespace"] = namespace
    assert len(objects) == 9, [(o["kind"], o["metadata"]["name"]) for o in objects]
    return objects


@contextmanager
def deployed(cluster: Cluster, images: dict[str, str], folder: Path) -> Iterator[LapseUp]:
    """`lapse up` and its NATS Ready in a new restricted namespace; all removed after."""
    namespace = f"up-{uuid.uuid4().hex[:8]}"
    volume_dir = PV_ROOT / namespace
    volume_dir.mkdir(parents=True)
    # A provisioner's volume belongs to the pod's fsGroup; a hostPath gets no such change,
    # so it is made the NATS user's here.
    os.chown(volume_dir, UID, UID)
    cluster.kubectl("create", "namespace", namespace)
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
        *nats_objects(namespace, images), *lapse_up_objects(namespace, images),
    ]  # fmt: skip
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                               "items": items}))  # fmt: skip
        kubectl_waiting(cluster, "-n", namespace, "rollout", "status", "deploy/nats",
                        timeout=180)  # fmt: skip
        claim = cluster.get(namespace, "pvc/nats-data")
        assert claim["status"]["phase"] == "Bound", claim["status"]
        ip = cluster.get(namespace, "service/nats")["spec"]["clusterIP"]
        (folder / "password").write_text(passwords[ADMIN.user])
        (folder / "lapse.yaml").write_text(yaml.safe_dump({"nats": {"replicas": 1}}))
        up = LapseUp(
            namespace, f"nats://{ip}:4222", passwords[ADMIN.user], volume_dir,
            folder / "lapse.yaml",
        )  # fmt: skip
        # The streams, by lapse's own command, as the lapse-streams pod makes them.
        applied = up.cli("infra", "apply")
        assert applied.returncode == 0, applied.stderr
        # `lapse up`: admitted, Ready (its NATS, its watch and its functions up).
        kubectl_waiting(cluster, "-n", namespace, "rollout", "status", "deploy/lapse",
                        timeout=240)  # fmt: skip
        yield up
    finally:
        cluster.kubectl("-n", namespace, "delete", "deploy", "nats", "lapse", "--wait=true",
                        check=False)  # fmt: skip
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", f"lapse-nats-{namespace}", "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", f"lapse-watch-{namespace}",
                        "--wait=false", check=False)  # fmt: skip
        shutil.rmtree(volume_dir, ignore_errors=True)
