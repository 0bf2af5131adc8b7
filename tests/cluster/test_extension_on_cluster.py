"""The example extension (examples/notify-on-cleanup) on the real cluster (issue 17): only
its folder is applied next to lapse (its Knative Service and its Trigger, the image from
`make images`), and it receives the `dev.lapse.cleanup.completed.v1` of a Workflow lapse
deleted: the object-reaper writes the outcome to NATS, `lapse bridge` delivers it to the
Broker, the extension's Trigger to the function, which prints one line per event (read
with `kubectl logs`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import REPO, poll
from tests.cluster.lapse_on_cluster import SYSTEM, Deployment, Written, kubectl_apply_retrying

EXAMPLE = REPO / "examples/notify-on-cleanup"
SERVICE = "notify-on-cleanup"


@pytest.fixture
def extension(lapse: Deployment, tmp_path: Path) -> Iterator[str]:
    """The example folder applied as it is, but for the image (the pushed one)."""
    name = "dev.local/lapse/notify-on-cleanup"
    ref = lapse.images[name]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(EXAMPLE, tmp_path)],
        "images": [{"name": name, "newName": ref.rsplit(":", 1)[0],
                    "newTag": ref.rsplit(":", 1)[1]}],
    }  # fmt: skip
    (tmp_path / "kustomization.yaml").write_text(json.dumps(kustomization))
    cluster = lapse.cluster
    kubectl_apply_retrying(cluster, "-k", str(tmp_path))
    try:
        cluster.wait_ready(SYSTEM, f"ksvc/{SERVICE}", timeout=180)
        cluster.wait_ready(SYSTEM, f"trigger/{SERVICE}", timeout=120)
        yield SERVICE
    finally:
        cluster.kubectl("delete", "-k", str(tmp_path), "--wait=false", check=False)


def test_the_example_extension_receives_cleanup_completed(
    lapse: Deployment, extension: str
) -> None:
    got = Written(lapse, 15, "notify").write().deleted()

    def lines() -> list[str]:
        out = lapse.cluster.kubectl(
            "-n", SYSTEM, "logs", "-l", f"serving.knative.dev/service={extension}",
            "-c", "function", "--tail=-1", "--prefix", check=False,
        )  # fmt: skip
        return [line for line in out.splitlines() if f"uid={got.uid}" in line]

    try:
        found = poll(f"{extension} logged the outcome of {got.name}", lines, timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{lapse.diagnosis()}") from None
    line = found[0]
    # At least once: a redelivery is the same event (its id derives from the due event's).
    assert len({text.split(" id=", 1)[1].split()[0] for text in found}) == 1, found
    assert "cleanup.completed" in line and "outcome=deleted" in line, line
    assert f"run=default/{got.name}" in line and "target=kubernetes" in line, line
    print(f"\nWorkflow {got.name} deleted {got.lateness:.2f} s after its deadline; {line}")
