"""Helpers for the tests of the kustomize package (infra/overlays/*): kubectl built from the
Kubernetes release the test API server runs (scripts/build-kubectl.sh, cached outside the
repository), each overlay rendered by it, and the pinned Knative CRDs."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.embedded.kube import go_module_dir
from lapse.embedded.process import ServerStartError
from tests.conftest import install_crd

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
OVERLAYS = ("dev", "production", "single-process")

# Knative releases pinned for the package (Knative Eventing 1.20 / Serving 1.21 modules).
KNATIVE = {
    "eventing": ("knative.dev/eventing", "v0.50.0", "config/core/resources"),
    "serving": ("knative.dev/serving", "v0.51.0", "config/core/300-resources"),
}
KNATIVE_CRD_FILES = {
    "eventing": (
        "broker.yaml",
        "trigger.yaml",
        "apiserversource.yaml",
        "sinkbindings.yaml",
        "eventpolicy.yaml",
    ),
    "serving": ("service.yaml",),
}


@functools.cache
def kubectl() -> Path:
    """kubectl v1.35.4, built once (about 40 s with a warm Go cache, 4 min cold)."""
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts/build-kubectl.sh")],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"could not build kubectl: {exc.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


@functools.cache
def prometheus_operator_crds() -> list[dict[str, Any]]:
    """The Prometheus Operator's CRDs infra/components/monitoring uses (PodMonitor,
    PrometheusRule), generated from the operator's API module and cached
    (scripts/build-prometheus-operator-crds.sh). Fails (never skips) without them."""
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts/build-prometheus-operator-crds.sh")],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"could not make the Prometheus Operator's CRDs: {exc.stderr[-2000:]}")
    folder = Path(out.stdout.strip().splitlines()[-1])
    return [
        yaml.safe_load((folder / f"monitoring.coreos.com_{plural}.yaml").read_text())
        for plural in ("podmonitors", "servicemonitors", "prometheusrules")
    ]


@functools.cache
def rendered_text(overlay: str) -> str:
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(INFRA / "overlays" / overlay)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return out.stdout


def rendered(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered_text(overlay)) if doc]


def knative_crds() -> list[dict[str, Any]]:
    """The pinned Knative CRDs lapse's manifests use. Fails (never skips) without them."""
    crds = []
    for part, (module, version, folder) in KNATIVE.items():
        try:
            base = go_module_dir(module, version) / folder
        except ServerStartError as exc:
            pytest.fail(f"cannot read Knative's CRDs: {module}@{version}: {exc}")
        for name in KNATIVE_CRD_FILES[part]:
            crds += [doc for doc in yaml.safe_load_all((base / name).read_text()) if doc]
    return crds


def schema_of(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version and v["served"]:
            schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"{crd['metadata']['name']} does not serve {version}")


def unknown_fields(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Fields the schema does not declare, even below x-kubernetes-preserve-unknown-fields
    (where the API server keeps anything, so a misspelt field would pass unnoticed)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in ("apiVersion", "kind", "metadata") and not where:
                continue
            if key not in schema["properties"]:
                found.append(f"{where}.{key}")
            else:
                found += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{where}[{i}]")
    return found


def install_crds(api_client: client.ApiClient, crds: list[dict[str, Any]]) -> None:
    for crd in crds:
        try:
            install_crd(api_client, crd)
        except ApiException as exc:  # another test of the session installed it already
            if exc.status != 409:
                raise


def rendered_with_components(
    overlay: str, components: list[str], where: Path
) -> list[dict[str, Any]]:
    """An overlay as a user turns on opt-in Components (infra/components/<name>): its
    kustomization with them listed first (before lapse-pods, whose patches must reach what
    they add), rendered from a copy beside links to the rest of infra/."""
    root = where / "infra"
    root.mkdir()
    for child in INFRA.iterdir():
        if child.name != "overlays":
            (root / child.name).symlink_to(child)
    copy = root / "overlays" / overlay
    shutil.copytree(INFRA / "overlays" / overlay, copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    added = [f"../../components/{name}" for name in components]
    kustomization["components"] = added + kustomization.get("components", [])
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(copy)], capture_output=True, text=True
    )  # fmt: skip
    assert out.returncode == 0, f"kubectl kustomize {overlay} + {components}: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
