"""Every pod lapse ships meets Pod Security `restricted` (infra/components/lapse-pods), in
every overlay: checked rule by rule on the rendered pod specs, and by the real
kube-apiserver's PodSecurity admission, which refuses (dry run) a pod that breaks the
profile in a namespace labelled as infra/base/namespace.yaml labels lapse-system.
tests/cluster/test_pod_security_on_cluster.py proves the same pods run and turn Ready."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import KubeStack
from tests.infra_package import OVERLAYS, ROOT, kubectl, rendered

UID = 65532
# The volume types `restricted` allows (Pod Security Standards, "Volume Types").
ALLOWED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip
SYSTEM = "lapse-system"


def pods(overlay: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, pod spec) of every pod template the overlay ships."""
    for doc in rendered(overlay):
        knative = doc["apiVersion"].startswith("serving.knative.dev")
        if doc["kind"] in ("Deployment", "StatefulSet", "Job") or (
            knative and doc["kind"] == "Service"
        ):
            yield f"{doc['kind']} {doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """The rules of the `restricted` profile (baseline's included) this pod spec breaks."""
    found = []
    pod = spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            found.append(flag)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']}: {kinds - ALLOWED_VOLUMES}")
    if pod.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for container in spec.get("initContainers", []) + spec["containers"]:
        name = container["name"]
        ctx = container.get("securityContext", {})
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if not (ctx.get("runAsNonRoot") or (pod.get("runAsNonRoot") and "runAsNonRoot" not in ctx)):
            found.append(f"{name}: runAsNonRoot not true")
        if ctx.get("runAsUser", pod.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        capabilities = ctx.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropping ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added {capabilities['add']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_profile(overlay: str) -> None:
    checked = dict(pods(overlay))
    assert checked, overlay
    for label, spec in checked.items():
        assert restricted_violations(spec) == [], label


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_as_lapses_user_on_a_read_only_root(overlay: str) -> None:
    for label, spec in pods(overlay):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert (ctx["runAsUser"], ctx["runAsGroup"]) == (UID, UID), label
            assert ctx["readOnlyRootFilesystem"] is True, label
            # ... with a writable /tmp of its own.
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], label


def test_the_rule_check_catches_what_the_profile_forbids() -> None:
    (spec,) = [s for label, s in pods("dev") if label == "Deployment lapse-bridge"]
    assert restricted_violations(spec) == []
    for breaking, expected in [
        ({"allowPrivilegeEscalation": True}, "allowPrivilegeEscalation"),
        ({"runAsNonRoot": False}, "runAsNonRoot"),
        ({"seccompProfile": {"type": "Unconfined"}}, "seccompProfile"),
        ({"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}}, "capabilities added"),
    ]:
        broken = copy.deepcopy(spec)
        broken["containers"][0]["securityContext"].update(breaking)
        assert any(expected in v for v in restricted_violations(broken)), breaking


def test_lapse_system_enforces_the_restricted_profile() -> None:
    for overlay in OVERLAYS:
        (namespace,) = [d for d in rendered(overlay) if d["kind"] == "Namespace"]
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted", overlay


def as_pod(label: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A Pod from a workload's template, as its controller would create it. Knative fills a
    probe's port with the container's; here 8080, the port func-python listens on."""
    spec = copy.deepcopy(spec)
    spec.pop("restartPolicy", None)
    for container in spec["containers"]:
        for probe in ("readinessProbe", "livenessProbe"):
            get = container.get(probe, {}).get("httpGet")
            if get is not None and "port" not in get:
                get["port"] = 8080
    name = label.split(" ", 1)[1]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": SYSTEM}, "spec": spec}  # fmt: skip


def dry_run_pods(kube: KubeStack, items: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "create", "--dry-run=server",
         "-f", "-"],
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.kube
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_api_servers_pod_security_admission_admits_every_pod(
    kube: KubeStack, overlay: str
) -> None:
    (namespace,) = [d for d in rendered(overlay) if d["kind"] == "Namespace"]
    core = client.CoreV1Api(kube.api_client)
    kube.namespace(SYSTEM)
    core.patch_namespace(SYSTEM, {"metadata": {"labels": namespace["metadata"]["labels"]}})
    items = [as_pod(label, spec) for label, spec in pods(overlay)]
    out = dry_run_pods(kube, items)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("(server dry run)") == len(items), out.stdout
    assert "violate" not in out.stderr, out.stderr

    # The same admission refuses a pod that breaks the profile: the check above can fail.
    broken = copy.deepcopy(items[0])
    broken["metadata"]["name"] += "-root"
    broken["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] = False
    refused = dry_run_pods(kube, [broken])
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted' in refused.stderr, refused.stderr


def test_the_example_extension_may_run_beside_lapse() -> None:
    """examples/notify-on-cleanup deploys into lapse-system, which enforces the profile."""
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(ROOT / "examples" / "notify-on-cleanup")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (service,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Service"]
    assert service["metadata"]["namespace"] == SYSTEM
    assert restricted_violations(service["spec"]["template"]["spec"]) == []
