"""Helpers for the tests of the Helm chart (charts/lapse): helm built from the Go module
proxy (scripts/build-helm.sh, cached outside the repository) and the chart rendered by it."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "lapse"
# The chart's settings for each kustomize overlay (infra/overlays/<name>).
CI_VALUES = {
    "dev": CHART / "ci" / "dev-values.yaml",
    "production": CHART / "ci" / "production-values.yaml",
    "single-process": CHART / "ci" / "single-process-values.yaml",
}
# What the cluster serves, for `helm template` (which asks no cluster): the overlays watch
# Argo's Workflows besides Jobs (infra/components/kinds/argo).
ARGO_SERVED = ("--api-versions", "argoproj.io/v1alpha1/Workflow")


def built(script: str, what: str) -> Path:
    """The binary a scripts/build-*.sh builds (cached by version) and names last."""
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / script)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"could not build {what}: {exc.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


@functools.cache
def helm() -> Path:
    """helm v3.22.0, built once (about 3 minutes cold, cached after)."""
    return built("build-helm.sh", "helm")


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(helm()), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, f"helm {' '.join(args)}: {out.stderr[-3000:]}"
    return out


def template_text(*args: str, namespace: str = "lapse-system") -> str:
    """`helm template lapse charts/lapse -n <namespace> <args>`: the manifests."""
    return run_helm("template", "lapse", str(CHART), "--namespace", namespace, *args).stdout


def template(*args: str, namespace: str = "lapse-system") -> list[dict[str, Any]]:
    text = template_text(*args, namespace=namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def helm_docs() -> Path:
    """helm-docs v1.14.2, built once (scripts/build-helm-docs.sh, cached after)."""
    return built("build-helm-docs.sh", "helm-docs")


def generated_readme() -> str:
    """The chart's README.md as helm-docs generates it from values.yaml (printed, not written)."""
    out = subprocess.run(
        [str(helm_docs()), "--chart-search-root", str(CHART.parent), "--sort-values-order",
         "file", "--log-level", "warning", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout
