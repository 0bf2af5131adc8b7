"""Inside a pod, lapse finds the cluster as kubectl and client-go do: with no kubeconfig,
the pod's ServiceAccount (the address in the environment, the mounted token and CA).

The pod is simulated around the real kube-apiserver: the environment the kubelet sets, and
the token and CA files it mounts, written to a temporary directory (the client's paths are
pointed there, since /var/run/secrets is the kubelet's to mount)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kubernetes import client
from kubernetes.config import incluster_config

from lapse.cli.up_run import has_cluster
from lapse.config import LapseConfig
from lapse.edges.kubernetes import load_api_client
from lapse.edges.kubernetes.client import in_a_pod
from tests.conftest import KubeStack

pytestmark = [pytest.mark.kube]


@pytest.fixture
def in_a_pod_of(kube: KubeStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = tmp_path / "serviceaccount"
    secrets.mkdir()
    (secrets / "token").write_text(kube.server.admin_token)
    (secrets / "ca.crt").write_bytes(
        (kube.server.work_dir / "certs" / "apiserver.crt").read_bytes()
    )
    url = urlsplit(kube.server.url)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", url.hostname or "")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(url.port))
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(secrets / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(secrets / "ca.crt"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config


def test_a_pod_without_a_kubeconfig_uses_its_service_account(in_a_pod_of: None) -> None:
    assert in_a_pod()
    assert has_cluster(LapseConfig())  # so `lapse up` starts no embedded kube-apiserver
    api = load_api_client()
    names = {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}
    assert "default" in names


def test_outside_a_pod_nothing_is_guessed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not in_a_pod()
    assert not has_cluster(LapseConfig())
