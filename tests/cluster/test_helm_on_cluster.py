"""The Helm chart (charts/lapse) on the real cluster, as a user runs it, in each shape
(`knative`: the functions behind the Broker, with Knative's OIDC on; `singleProcess`):
`helm install` (the chart's own NATS, its own namespace and a scratch namespace to clean),
lapse deletes a finished Workflow when its TTL is up, `helm upgrade` with a changed value
rolls lapse and it still deletes, and `helm uninstall` leaves nothing of lapse's behind but
what docs/helm.md says it keeps (the generated Secret lapse-nats-users) and the Secret the
user made (lapse-ingress).

Independent of the kustomize deployment the other tests share (the `lapse` fixture): other
namespaces, and cluster-scoped names that carry the release namespace."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from lapse.embedded.kube import run_kind_crds
from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_on_cluster import (
    DeletionWatch,
    finished_workflow,
    kubectl_waiting,
    push_images,
)
from tests.helm_chart import CHART, helm

RELEASE = "lapse"
NAMESPACE = "lapse-helm"
TIMEOUT = "6m"
# What `helm uninstall` leaves in the release namespace, by design: the NATS passwords the
# chart's Job generated (not the release's: docs/helm.md), the Secret the user created, and
# what Kubernetes puts in every namespace.
KEPT = {
    "Secret/lapse-nats-users",
    "Secret/lapse-ingress",
    "ConfigMap/kube-root-ca.crt",
    "ServiceAccount/default",
}
NAMESPACED = (
    "deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,jobs,roles,"
    "rolebindings,networkpolicies,poddisruptionbudgets,endpointslices"
)


class Helm:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [str(helm()), "--kubeconfig", self.cluster.kubeconfig, "--namespace", NAMESPACE,
             *args],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {out.stderr[-3000:]}\n{self.diagnosis()}")
        return out

    def diagnosis(self) -> str:
        """What an engineer looks at first when something does not happen."""
        k = self.cluster.kubectl
        parts = [
            k("-n", NAMESPACE, "get", "all,jobs,secrets", "-o", "wide", check=False),
            k("-n", NAMESPACE, "get", "ksvc,broker,trigger,apiserversource,sinkbinding",
              check=False),
            k("-n", NAMESPACE, "get", "events", "--sort-by=.lastTimestamp", check=False)[-3000:],
        ]  # fmt: skip
        for selector, container in (
            ("app.kubernetes.io/name=lapse", "lapse"),
            ("serving.knative.dev/service=lapse-ttl-planner", "function"),
            ("serving.knative.dev/service=lapse-object-reaper", "function"),
            ("app.kubernetes.io/name=lapse-bridge", "bridge"),
            ("sources.knative.dev/apiServerSource=lapse-workflows", ""),
        ):
            which = ["-c", container] if container else ["--all-containers"]
            logs = k("-n", NAMESPACE, "logs", "-l", selector, *which, "--tail=25", check=False)
            parts.append(f"--- logs {selector}\n{logs}")
        return "\n".join(parts)


@pytest.fixture
def release(cluster: Cluster) -> Iterator[Helm]:
    run = Helm(cluster)
    run("uninstall", RELEASE, "--wait", check=False)  # a run that failed half-way
    # The previous shape's namespace may still be going (Knative's finalizers, on a loaded
    # node, took over 120 s once): waited for on its own clock, not Cluster.kubectl's.
    kubectl_waiting(cluster, "delete", "namespace", NAMESPACE, "--ignore-not-found",
                    "--wait=true", timeout=300)  # fmt: skip
    cluster.kubectl("create", "namespace", NAMESPACE)
    try:
        yield run
    finally:
        run("uninstall", RELEASE, "--wait", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


IMAGE_VALUES = {
    "lapse": "lapse",
    "ttl-planner": "ttlPlanner",
    "object-reaper": "objectReaper",
    "row-reaper": "rowReaper",
}
# What the knative shape has Ready before a Workflow is written (beyond `helm --wait`,
# which knows Deployments, not Knative's objects).
KNATIVE_READY = (
    "broker/lapse", "sinkbinding/lapse-bridge", "ksvc/lapse-ttl-planner",
    "ksvc/lapse-object-reaper", "ksvc/lapse-row-reaper", "trigger/ttl-planner",
    "trigger/object-reaper-due",
    "apiserversource/lapse-workflows", "eventpolicy/lapse-broker",
)  # fmt: skip
# The Deployment a changed lapse.yaml must roll, per shape.
ROLLED = {"singleProcess": "lapse", "knative": "lapse-bridge"}


def image_values(images: dict[str, str]) -> dict[str, Any]:
    """The pushed images as the chart's values (registry, repository, tag)."""
    values: dict[str, Any] = {}
    for name, key in IMAGE_VALUES.items():
        registry, rest = images[f"dev.local/lapse/{name}"].split("/", 1)
        repository, tag = rest.rsplit(":", 1)
        values["registry"] = registry
        values[key] = {"repository": repository, "tag": tag}
    return values


def deleted_when_due(
    release: Helm, cluster: Cluster, namespace: str, prefix: str, ttl: int = 5
) -> float:
    """A finished Workflow with lapse.dev/ttl, deleted by lapse no earlier than its
    deadline: returns how late (seconds)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    watch = DeletionWatch(cluster, namespace, name)
    try:
        time.sleep(1)  # the watch is established (its first list comes back empty)
        finished_at = datetime.now(UTC).replace(microsecond=0)
        workflow = finished_workflow(name, finished_at, f"{ttl}s")
        created = json.loads(
            cluster.kubectl(
                "-n", namespace, "create", "-o", "json", "-f", "-", stdin=json.dumps(workflow)
            )
        )
        watch.added()
        deadline = (finished_at + timedelta(seconds=ttl)).timestamp()
        try:
            deleted_at = watch.deleted_at(created["metadata"]["uid"], timeout=ttl + 180)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {name}\n{release.diagnosis()}") from None
    finally:
        watch.stop()
    assert deleted_at >= deadline, f"{name} deleted {deadline - deleted_at:.2f} s early"
    return deleted_at - deadline


def pod_of(cluster: Cluster, deployment: str) -> str:
    """The uid of the one running pod of a Deployment."""
    out = cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l",
                          f"app.kubernetes.io/name={deployment}", "-o", "json")  # fmt: skip
    pods = json.loads(out)["items"]
    running = [p for p in pods if "deletionTimestamp" not in p["metadata"]]
    assert len(running) == 1, [p["metadata"]["name"] for p in pods]
    uid: str = running[0]["metadata"]["uid"]
    return uid


def leftovers(cluster: Cluster, namespace: str) -> set[str]:
    out = cluster.kubectl("-n", namespace, "get", NAMESPACED, "-o", "json")
    items = json.loads(out)["items"]
    return {f"{i['kind']}/{i['metadata']['name']}" for i in items}


@pytest.mark.parametrize("shape", ["singleProcess", "knative"])
def test_install_delete_upgrade_uninstall(
    cluster: Cluster, release: Helm, namespace: str, tmp_path: Path, shape: str
) -> None:
    started = time.monotonic()
    images = push_images()
    crds = {"apiVersion": "v1", "kind": "List", "items": list(run_kind_crds())}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(crds))
    cluster.kubectl(
        "wait", "crd/workflows.argoproj.io", "--for=condition=Established", "--timeout=60s"
    )
    # The Secret docs/deploy.md asks for: without it lapse up does not start.
    cluster.kubectl(
        "-n", NAMESPACE, "create", "secret", "generic", "lapse-ingress",
        f"--from-literal=token={secrets.token_hex(32)}",
    )  # fmt: skip
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "shape": shape,
                "namespaces": [namespace],
                "images": image_values(images),
                "config": {"safety": {"max_deletions_per_second": 5}},
                # Warm functions: this checks the chart's wiring, not how fast a pod starts
                # from zero on a loaded machine (test_pipeline_on_knative.py does that).
                "knative": {"functions": {"minScale": 1}},
                # The node is 2 cores, already holding Knative and this session's kustomize
                # deployment of lapse: the chart's measured requests (defaultResources,
                # 50-100m of CPU a container) leave the scheduler "Insufficient cpu" for a
                # second lapse. One small request for every container instead; the
                # defaults themselves are rendered and dry-run by test_chart.py.
                "resources": {"requests": {"cpu": "5m", "memory": "32Mi"}},
            }
        )
    )

    if shape == "knative":
        # For the SinkBinding's webhook whichever selection mode the cluster uses.
        cluster.kubectl("label", "namespace", NAMESPACE, "bindings.knative.dev/include=true")

    # lapse's CRDs are the chart's templates now (crds.install); the kustomize deployment
    # of this session may have applied them first, which Helm adopts only when told
    # (docs/helm.md, "CRDs"). helm.sh/resource-policy: keep leaves them on uninstall.
    installed_out = release("install", RELEASE, str(CHART), "--values", str(values), "--wait",
                            "--take-ownership", "--timeout", TIMEOUT)  # fmt: skip
    # The chart's NOTES: what was installed, where, cleaning what.
    assert f"({shape}) in {NAMESPACE}, cleaning: {namespace}." in installed_out.stdout
    if shape == "knative":
        for what in KNATIVE_READY:
            try:
                cluster.wait_ready(NAMESPACE, what, timeout=240)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{release.diagnosis()}") from None
        # The SinkBinding gave the bridge its K_SINK: a new rollout.
        cluster.kubectl("-n", NAMESPACE, "rollout", "status", "deploy/lapse-bridge",
                        "--timeout=110s")  # fmt: skip
    installed = time.monotonic() - started
    first = deleted_when_due(release, cluster, namespace, "helm-install")
    before = pod_of(cluster, ROLLED[shape])

    release("upgrade", RELEASE, str(CHART), "--reuse-values",
            "--set", "config.safety.max_deletions_per_second=7", "--wait",
            "--timeout", TIMEOUT)  # fmt: skip
    config = yaml.safe_load(cluster.get(NAMESPACE, "configmap/lapse")["data"]["lapse.yaml"])
    assert config["safety"]["max_deletions_per_second"] == 7
    # The changed lapse.yaml rolled lapse (the pod template's checksum/config).
    assert pod_of(cluster, ROLLED[shape]) != before
    second = deleted_when_due(release, cluster, namespace, "helm-upgrade")
    history = json.loads(release("history", RELEASE, "-o", "json").stdout)
    assert [h["status"] for h in history] == ["superseded", "deployed"]

    release("uninstall", RELEASE, "--wait", "--timeout", TIMEOUT)
    # Pods go after their Deployment (the garbage collector): wait for them too.
    try:
        poll(
            "nothing of the release left in its namespace but what it keeps",
            lambda: leftovers(cluster, NAMESPACE) <= KEPT,
            timeout=120,
        )
    except AssertionError as exc:
        left = sorted(leftovers(cluster, NAMESPACE) - KEPT)
        raise AssertionError(f"{exc}; still there: {left}") from None
    assert leftovers(cluster, NAMESPACE) == KEPT
    # Nothing in the cleaned namespace (its Roles, RoleBinding) or cluster-wide.
    assert not {o for o in leftovers(cluster, namespace) if o.split("/")[1].startswith("lapse")}, (
        leftovers(cluster, namespace)
    )
    cluster_wide = cluster.kubectl(
        "get", "clusterroles,clusterrolebindings", "-l", "app.kubernetes.io/instance=lapse",
        "-o", "name",
    )  # fmt: skip
    assert not [
        line for line in cluster_wide.splitlines() if line.split("/")[1].startswith(NAMESPACE)
    ]
    # The CRDs stay (crds.keep): deleting one would delete every policy object.
    for crd in ("lapsepolicies.lapse.dev", "clusterlapsepolicies.lapse.dev"):
        kept = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json"))
        assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", crd
    print(
        f"\nhelm, {shape}: installed and Ready in {installed:.0f} s (images pushed); deletions "
        f"{first:.1f} s and {second:.1f} s after their deadlines (install, upgrade)"
    )
