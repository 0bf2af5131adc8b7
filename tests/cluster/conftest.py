"""Tests on the real single-node cluster: `make test-cluster` starts it (`make cluster`,
root), runs them and stops it; `make test` runs them after the rest of the suite."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.stack import POSTGRES_ADMIN_URL, Database

if TYPE_CHECKING:
    from tests.cluster.lapse_on_cluster import Deployment
    from tests.cluster.lapse_up_on_cluster import LapseUp

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Cluster:
    kubectl_bin: str
    kubeconfig: str
    python_image: str  # a Debian Python 3.11 in the local registry (containerd pulls it)
    node_ip: str  # the node's address: pods reach the host there
    containerd_sock: str  # the cluster's containerd (`ctr --address`)
    network_policy: str = "none"  # who enforces NetworkPolicy: "kube-router" or "none"

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def apply(self, namespace: str, manifest: str) -> None:
        self.kubectl("-n", namespace, "apply", "-f", "-", stdin=manifest)

    def get(self, namespace: str, what: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl("-n", namespace, "get", what, "-o", "json"))
        return out

    def wait_ready(self, namespace: str, what: str, timeout: float = 120) -> None:
        """Wait for a Knative object's Ready condition; on failure, say its conditions."""
        result = subprocess.run(
            [
                self.kubectl_bin,
                "--kubeconfig",
                self.kubeconfig,
                "-n",
                namespace,
                "wait",
                what,
                "--for=condition=Ready",
                f"--timeout={int(timeout)}s",
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            status = self.get(namespace, what).get("status", {})
            raise AssertionError(f"{what} not Ready: {status.get('conditions')}")


def json_objects(text: str) -> list[dict[str, Any]]:
    """The objects kubectl prints one after the other (`create -o json` of a List)."""
    decoder, objects, rest = json.JSONDecoder(), [], text.lstrip()
    while rest:
        item, end = decoder.raw_decode(rest)
        objects.append(item)
        rest = rest[end:].lstrip()
    return objects


def _cluster_env() -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(REPO / "scripts/cluster/env.sh")], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    env = _cluster_env()
    if not Path(env["KUBECONFIG"]).exists():
        pytest.fail("no cluster is running: `make cluster` first (make test-cluster does)")
    return Cluster(
        env["KUBECTL"],
        env["KUBECONFIG"],
        env["PYTHON_IMAGE"],
        env["NODE_IP"],
        env["CONTAINERD_SOCK"],
        env.get("NETWORK_POLICY", "none"),
    )


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def poll(what: str, probe: Any, timeout: float, interval: float = 1.0) -> Any:
    """Call probe() until it returns something truthy; fail with `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s: {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def lapse(
    cluster: Cluster, postgres: Database, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """lapse deployed once for the session (tests/cluster/lapse_on_cluster.py says how)."""
    from tests.cluster.lapse_on_cluster import deploy

    deployment, relay = deploy(
        cluster, tmp_path_factory.mktemp("overlay"), postgres, POSTGRES_ADMIN_URL
    )
    try:
        yield deployment
    finally:
        relay.stop()


@pytest.fixture(scope="session")
def lapse_up(
    cluster: Cluster, lapse: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LapseUp]:
    """`lapse up` (the single-process overlay) deployed once for the session in a scratch
    namespace it alone cleans, with the images `lapse` pushed (lapse_up_on_cluster.py)."""
    from tests.cluster.lapse_up_on_cluster import deployed

    with deployed(cluster, lapse.images, tmp_path_factory.mktemp("up")) as up:
        yield up
