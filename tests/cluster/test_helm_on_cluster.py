"""The Helm chart (charts/lapse) on the real cluster, as a user runs it, in each shape
(`knative`: the functions behind the Broker, with Knative's OIDC on; `singleProcess`), from
a release: this tree's `make release` (scripts/release.py, on the cached images) pushed to
the cluster's registry (`--push 127.0.0.1:5000`, docs/releasing.md), the chart pulled from
oci://127.0.0.1:5000/charts/lapse and every image by the digest release.json records.

`helm install` (the chart's own NATS, its own namespace and a scratch namespace to clean),
lapse deletes a finished Workflow when its TTL is up, `helm upgrade` with a changed value
rolls lapse and it still deletes, and `helm uninstall` leaves nothing of lapse's behind but
what docs/helm.md says it keeps (the generated Secret lapse-nats-users, the CRDs with
crds.keep) and the Secret the user made (lapse-ingress).

One install per shape (the CI budget): `knative` installs the release from the registry
and upgrades it with a changed value; `singleProcess` installs the release before this
one and upgrades it to the release from the registry, with the same values. No earlier
release was published, so "the release before" is the source tree's chart with its
images by tag (as `make images` pushed them), labelled chart PREVIOUS_VERSION: the label
Helm writes on every object, CRDs included, shows the upgrade rewrote the CRDs (templates,
not `crds/`: docs/helm.md, "CRDs") and the pods then run the release's digests.

Independent of the kustomize deployment the other tests share (the `lapse` fixture): other
namespaces, and cluster-scoped names that carry the release namespace."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
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
from tests.release_build import VERSION, build_release, push_release, release_manifest

RELEASE = "lapse"
NAMESPACE = "lapse-helm"
TIMEOUT = "6m"
# The cluster's registry (scripts/cluster/start.sh; plain HTTP), where containerd pulls from
# (the variable as scripts/cluster/push-lapse-images.py reads it).
REGISTRY = os.environ.get("LAPSE_CLUSTER_REGISTRY", "127.0.0.1:5000")
RELEASED_CHART = f"oci://{REGISTRY}/charts/lapse"
# The chart version "the release before" is labelled with (CHANGELOG.md's last before 0.2.0).
PREVIOUS_VERSION = "0.1.0"
# The shape that upgrades from the release before; the other installs the release.
FROM_PREVIOUS = "singleProcess"
# The lapse images each shape runs (artifacts.enabled is off: no artifact-reaper).
RUNS_IMAGES = {
    "singleProcess": {"lapse"},
    "knative": {"lapse", "ttl-planner", "object-reaper", "row-reaper"},
}
# What `helm uninstall` leaves in the release namespace, by design: the NATS passwords the
# chart's Job generated (not the release's: docs/helm.md), the Secret the user created, and
# what Kubernetes puts in every namespace.
KEPT = {
    "Secret/lapse-nats-users",
    "Secret/lapse-ingress",
    "ConfigMap/kube-root-ca.crt",
    "ServiceAccount/default",
}
CRDS = ("lapsepolicies.lapse.dev", "clusterlapsepolicies.lapse.dev")
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


@pytest.fixture(scope="module")
def published(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """This tree's release, built from the cached images and pushed to the cluster's
    registry (images with their digests, the chart as an OCI artifact): its release.json."""
    out = build_release(tmp_path_factory.mktemp("release") / VERSION)
    started = time.monotonic()
    push_release(out, REGISTRY)
    print(f"release pushed to {REGISTRY}: {time.monotonic() - started:.1f} s")
    return release_manifest(out)


def previous_chart(tmp_path: Path) -> Path:
    """The source tree's chart as the release before this one: Chart.yaml's version set to
    PREVIOUS_VERSION (files/crds' links copied as the files they name)."""
    chart = tmp_path / "previous" / "lapse"
    shutil.copytree(CHART, chart)
    meta = chart / "Chart.yaml"
    text, found = re.subn(
        r"^version: .*$", f"version: {PREVIOUS_VERSION}", meta.read_text(), flags=re.M
    )
    assert found == 1, "charts/lapse/Chart.yaml: no version"
    meta.write_text(text)
    return chart


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


def chart_values(
    shape: str, namespace: str, images: dict[str, Any], max_deletions_per_second: int
) -> dict[str, Any]:
    """The values this test installs and upgrades with."""
    return {
        "shape": shape,
        "namespaces": [namespace],
        "images": images,
        "config": {"safety": {"max_deletions_per_second": max_deletions_per_second}},
        # Warm functions: this checks the chart's wiring, not how fast a pod starts from
        # zero on a loaded machine (test_pipeline_on_knative.py does that).
        "knative": {"functions": {"minScale": 1}},
        # The node is 2 cores, already holding Knative and this session's kustomize
        # deployment of lapse: the chart's measured requests (defaultResources, 50-100m of
        # CPU a container) leave the scheduler "Insufficient cpu" for a second lapse. One
        # small request for every container instead; the defaults themselves are rendered
        # and dry-run by test_chart.py.
        "resources": {"requests": {"cpu": "5m", "memory": "32Mi"}},
    }


def write_values(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def lapse_images_running(cluster: Cluster) -> dict[str, str]:
    """container (pod/container) -> the lapse image its pod spec names, for every pod of
    the namespace that is running or starting (not going, not a finished Job's)."""
    pods = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-o", "json"))["items"]
    found: dict[str, str] = {}
    for pod in pods:
        if "deletionTimestamp" in pod["metadata"] or pod["status"].get("phase") in (
            "Succeeded",
            "Failed",
        ):
            continue
        spec = pod["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            if "/lapse/" in container["image"]:
                found[f"{pod['metadata']['name']}/{container['name']}"] = container["image"]
    return found


def release_refs(published: dict[str, Any]) -> dict[str, str]:
    """Each image's reference as the release's chart pins it in the cluster's registry."""
    return {
        name: f"{REGISTRY}/lapse/{name}:{VERSION}@{image['digest']}"
        for name, image in published["images"].items()
    }


def image_name(ref: str) -> str:
    """lapse/<name>'s name of a reference [registry/]lapse/<name>[:tag][@digest]."""
    return ref.split("/lapse/", 1)[1].split("@", 1)[0].split(":", 1)[0]


def assert_runs_the_release(
    cluster: Cluster, published: dict[str, Any], shape: str, timeout: float = 60
) -> None:
    """Every lapse container names its image as the release pins it: the registry's
    lapse/<name>:<version>@<the digest release.json records>. Polled: after `helm upgrade
    --wait` the old ReplicaSet's pod may not be marked for deletion yet."""
    wanted = release_refs(published)

    def on_release() -> bool:
        running = lapse_images_running(cluster)
        return bool(running) and all(wanted.get(image_name(r)) == r for r in running.values())

    with contextlib.suppress(AssertionError):  # what differs, asserted below
        poll("every lapse container on the release's digests", on_release, timeout=timeout)
    running = lapse_images_running(cluster)
    for container, ref in running.items():
        assert "@sha256:" in ref and ref == wanted.get(image_name(ref)), (
            container, ref, wanted.get(image_name(ref)),
        )  # fmt: skip
    assert {image_name(ref) for ref in running.values()} >= RUNS_IMAGES[shape], running


def crd_chart_labels(cluster: Cluster) -> dict[str, str]:
    """lapse's CRDs -> the chart (helm.sh/chart: lapse-<version>) that last wrote them."""
    return {
        crd: json.loads(cluster.kubectl("get", "crd", crd, "-o", "json"))["metadata"]["labels"][
            "helm.sh/chart"
        ]
        for crd in CRDS
    }


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
    cluster: Cluster,
    release: Helm,
    namespace: str,
    tmp_path: Path,
    shape: str,
    published: dict[str, Any],
) -> None:
    started = time.monotonic()
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
    # The release's chart pins its images by digest: only the registry is the user's.
    released_images = {"registry": REGISTRY}
    released_chart = (RELEASED_CHART, "--version", VERSION, "--plain-http")
    if shape == FROM_PREVIOUS:
        chart: tuple[str, ...] = (str(previous_chart(tmp_path)),)
        images, installed_version = image_values(push_images()), PREVIOUS_VERSION
    else:
        chart, images, installed_version = released_chart, released_images, VERSION
    values = write_values(tmp_path / "values.yaml", chart_values(shape, namespace, images, 5))

    if shape == "knative":
        # For the SinkBinding's webhook whichever selection mode the cluster uses.
        cluster.kubectl("label", "namespace", NAMESPACE, "bindings.knative.dev/include=true")

    # lapse's CRDs are the chart's templates now (crds.install); the kustomize deployment
    # of this session may have applied them first, which Helm adopts only when told
    # (docs/helm.md, "CRDs"). helm.sh/resource-policy: keep leaves them on uninstall.
    installed_out = release("install", RELEASE, *chart, "--values", str(values), "--wait",
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
    if shape == FROM_PREVIOUS:
        running = lapse_images_running(cluster)
        assert running and not [ref for ref in running.values() if "@" in ref], running
    else:
        assert_runs_the_release(cluster, published, shape)
    assert set(crd_chart_labels(cluster).values()) == {f"lapse-{installed_version}"}
    first = deleted_when_due(release, cluster, namespace, "helm-install")
    before = pod_of(cluster, ROLLED[shape])

    # The same values (the release's images but for the registry), one of them changed.
    upgraded = chart_values(shape, namespace, released_images, 7)
    release("upgrade", RELEASE, *released_chart,
            "--values", str(write_values(tmp_path / "upgrade.yaml", upgraded)),
            "--wait", "--timeout", TIMEOUT)  # fmt: skip
    config = yaml.safe_load(cluster.get(NAMESPACE, "configmap/lapse")["data"]["lapse.yaml"])
    assert config["safety"]["max_deletions_per_second"] == 7
    # lapse runs the release's digests (from the release before: the pods rolled to them),
    # and the CRDs are the release's (upgraded with it).
    assert_runs_the_release(cluster, published, shape)
    assert set(crd_chart_labels(cluster).values()) == {f"lapse-{VERSION}"}
    # The changed lapse.yaml (and, from the release before, the images) rolled lapse.
    assert pod_of(cluster, ROLLED[shape]) != before
    second = deleted_when_due(release, cluster, namespace, "helm-upgrade")
    history = json.loads(release("history", RELEASE, "-o", "json").stdout)
    assert [(h["status"], h["chart"]) for h in history] == [
        ("superseded", f"lapse-{installed_version}"),
        ("deployed", f"lapse-{VERSION}"),
    ]

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
    for crd in CRDS:
        kept = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json"))
        assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", crd
        assert kept["metadata"]["labels"]["helm.sh/chart"] == f"lapse-{VERSION}", crd
    print(
        f"\nhelm, {shape}: lapse-{installed_version} installed and Ready in {installed:.0f} s "
        f"(images pushed); deletions {first:.1f} s and {second:.1f} s after their deadlines "
        f"(install, upgrade to lapse-{VERSION} from {REGISTRY})"
    )
