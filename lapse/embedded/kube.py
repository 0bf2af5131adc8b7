"""A local Kubernetes control plane: etcd + kube-apiserver, no controllers.

Started the way controller-runtime's envtest starts one: etcd on free loopback ports with a
throwaway data dir, kube-apiserver self-signing its serving certificate, RBAC on, and token
authentication. Nothing runs the Argo controller: whoever uses this writes Workflow status
themselves, which is exactly the part of the object lapse reads.

The binaries are built from the Go module proxy by `build-kube.sh` (next to this file) and
cached outside any repository, keyed by version.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lapse import infra
from lapse.embedded.process import (
    PRIVATE_UMASK,
    ServerStartError,
    free_port,
    port_open,
    private_dir,
    spawn,
    stop,
    wait_until,
    write_private,
)

KUBE_VERSION = "v1.35.4"
ARGO_WORKFLOWS_VERSION = "v3.7.9"
ARGO_MODULE = "github.com/argoproj/argo-workflows/v3"
TEKTON_VERSION = "v1.6.0"
TEKTON_MODULE = "github.com/tektoncd/pipeline"
TRAINER_VERSION = "v2.0.0"
TRAINER_MODULE = "github.com/kubeflow/trainer/v2"
# The opt-in kinds' CRDs (events/kinds.py), from each project's own Go module at a
# version the module proxy serves.
KUBERAY_VERSION = "v1.5.1"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
JOBSET_VERSION = "v0.11.1"
JOBSET_MODULE = "sigs.k8s.io/jobset"
SPARK_OPERATOR_VERSION = "v2.4.0"
SPARK_OPERATOR_MODULE = "github.com/kubeflow/spark-operator/v2"
BUILD_SCRIPT = Path(__file__).with_name("build-kube.sh")

ADMIN_USER = "admin"
READONLY_USER = "lapse-readonly"


def cache_root() -> Path:
    if root := os.environ.get("LAPSE_CACHE"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "lapse"


def kube_binaries(version: str = KUBE_VERSION, *, build: bool = True) -> Path:
    """The directory holding `etcd` and `kube-apiserver`, building them if needed."""
    directory = cache_root() / "kube" / version
    if not build:
        if (directory / "kube-apiserver").exists() and (directory / "etcd").exists():
            return directory
        raise ServerStartError(
            f"kube-apiserver {version} is not built yet: run `make kube` once (5-20 minutes)"
        )
    # The script is idempotent and returns at once when the cache is current.
    env = {**os.environ, "LAPSE_KUBE_VERSION": version, "LAPSE_CACHE": str(cache_root())}
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ServerStartError(
            f"building kube-apiserver {version} failed:\n{result.stderr[-4000:]}"
        )
    return directory


def go_module_dir(module: str, version: str) -> Path:
    """Download a pinned Go module into the module cache and return its directory."""
    try:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"],
            capture_output=True, text=True, check=True,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )  # fmt: skip
    except FileNotFoundError as exc:
        raise ServerStartError("the 'go' tool is needed to read pinned CRDs") from exc
    except subprocess.CalledProcessError as exc:
        raise ServerStartError(f"go mod download {module}@{version} failed: {exc.stderr}") from exc
    return Path(json.loads(out.stdout)["Dir"])


def argo_workflow_crd(version: str = ARGO_WORKFLOWS_VERSION) -> dict[str, object]:
    """The Workflow CRD exactly as Argo installs it by default (the `minimal` variant)."""
    path = (
        go_module_dir(ARGO_MODULE, version)
        / "manifests/base/crds/minimal/argoproj.io_workflows.yaml"
    )
    crd: dict[str, object] = yaml.safe_load(path.read_text())
    return crd


def tekton_crds(version: str = TEKTON_VERSION) -> list[dict[str, object]]:
    """The PipelineRun and TaskRun CRDs as Tekton installs them, without the conversion
    webhook (no Tekton controller runs here): objects are written in the storage version,
    v1, and v1beta1 is served by the API server's own no-op conversion."""
    crds = []
    for name in ("300-pipelinerun.yaml", "300-taskrun.yaml"):
        path = go_module_dir(TEKTON_MODULE, version) / "config/300-crds" / name
        crd: dict[str, Any] = yaml.safe_load(path.read_text())
        crd["spec"]["conversion"] = {"strategy": "None"}
        crds.append(crd)
    return crds


def trainjob_crd(version: str = TRAINER_VERSION) -> dict[str, object]:
    """Kubeflow Trainer's TrainJob CRD (KEP-2170)."""
    path = (
        go_module_dir(TRAINER_MODULE, version)
        / "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"
    )
    crd: dict[str, object] = yaml.safe_load(path.read_text())
    return crd


def rayjob_crd(version: str = KUBERAY_VERSION) -> dict[str, object]:
    """KubeRay's RayJob CRD (ray.io/v1, with v1alpha1 still served: no conversion)."""
    return _module_crd(KUBERAY_MODULE, version, "config/crd/bases/ray.io_rayjobs.yaml")


def jobset_crd(version: str = JOBSET_VERSION) -> dict[str, object]:
    """The JobSet CRD (jobset.x-k8s.io/v1alpha2), without the JobSet webhooks: nothing
    defaults or validates a JobSet here beyond its OpenAPI schema."""
    return _module_crd(
        JOBSET_MODULE, version, "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
    )


def sparkapplication_crd(version: str = SPARK_OPERATOR_VERSION) -> dict[str, object]:
    """The Spark Operator's SparkApplication CRD (sparkoperator.k8s.io/v1beta2)."""
    return _module_crd(
        SPARK_OPERATOR_MODULE,
        version,
        "config/crd/bases/sparkoperator.k8s.io_sparkapplications.yaml",
    )


def _module_crd(module: str, version: str, path: str) -> dict[str, object]:
    crd: dict[str, object] = yaml.safe_load((go_module_dir(module, version) / path).read_text())
    return crd


def run_kind_crds(*, opt_in: bool = False) -> list[dict[str, object]]:
    """The CRDs of the default kinds (events/kinds.py; Jobs are built into Kubernetes),
    and with `opt_in` also those of the opt-in ones (RayJob, JobSet, SparkApplication),
    which only the tests need: `lapse up` does not download three more modules for kinds
    its default configuration does not watch."""
    crds = [argo_workflow_crd(), *tekton_crds(), trainjob_crd()]
    if opt_in:
        crds += [rayjob_crd(), jobset_crd(), sparkapplication_crd()]
    return crds


def policy_crds() -> list[dict[str, object]]:
    """lapse's own CRDs, LapsePolicy and ClusterLapsePolicy (infra/crds/), as shipped."""
    return [
        yaml.safe_load(infra.read_text(f"crds/{name}.yaml"))
        for name in ("lapsepolicy", "clusterlapsepolicy")
    ]


@dataclass
class EmbeddedKube:
    """etcd + kube-apiserver on loopback, with two token users: an admin (system:masters)
    and `lapse-readonly`, who has no rights until a test binds some with RBAC."""

    work_dir: Path
    version: str = KUBE_VERSION
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    port: int = field(default_factory=free_port)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    readonly_token: str = field(default_factory=lambda: secrets.token_hex(16))
    extra_args: tuple[str, ...] = ()
    etcd: subprocess.Popen[bytes] | None = None
    apiserver: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def kubeconfig_path(self) -> Path:
        return self.work_dir / "kubeconfig"

    def start(self, timeout: float = 120.0) -> EmbeddedKube:
        binaries = kube_binaries(self.version)
        # The tokens (one of them system:masters), the kubeconfig and the keys: 0600 in 0700.
        private_dir(self.work_dir)
        self._start_etcd(binaries / "etcd", timeout)
        self._start_apiserver(binaries / "kube-apiserver", timeout)
        self._write_kubeconfig()
        return self

    def stop(self) -> None:
        stop(self.apiserver)
        stop(self.etcd)
        self.apiserver = self.etcd = None

    def kill_apiserver(self) -> None:
        """SIGKILL the API server (an upgrade or a crash); etcd keeps the data."""
        if self.apiserver is not None:
            self.apiserver.kill()
            self.apiserver.wait(timeout=30)
            self.apiserver = None

    def restart_apiserver(self, timeout: float = 120.0) -> None:
        """Start the API server again on the same port, certificates and tokens."""
        self._start_apiserver(kube_binaries(self.version) / "kube-apiserver", timeout)

    def kill_etcd(self) -> None:
        """SIGKILL etcd (a crash, or its node lost); the API server stays up, answering
        errors or nothing until etcd is back. The data directory is kept."""
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait(timeout=30)
            self.etcd = None

    def restart_etcd(self, timeout: float = 120.0) -> None:
        """Start etcd again on the same ports and data, and wait until the API server is
        ready again (it reconnects by itself)."""
        self._start_etcd(kube_binaries(self.version) / "etcd", timeout)
        if self.apiserver is not None:
            wait_until(
                lambda: _http_ok(f"{self.url}/readyz", self.admin_token),
                process=self.apiserver, what="kube-apiserver", timeout=timeout,
                log_path=self.work_dir / "kube-apiserver.log",
            )  # fmt: skip

    def _start_etcd(self, binary: Path, timeout: float) -> None:
        log = self.work_dir / "etcd.log"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self.etcd = spawn(
            [
                str(binary),
                "--name", "lapse",
                "--data-dir", str(self.work_dir / "etcd"),
                "--listen-client-urls", self.etcd_url,
                "--advertise-client-urls", self.etcd_url,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"lapse={peer}",
                "--unsafe-no-fsync",
            ],
            log,
        )  # fmt: skip
        wait_until(
            lambda: _http_ok(f"{self.etcd_url}/health"),
            process=self.etcd, what="etcd", log_path=log, timeout=timeout,
        )  # fmt: skip

    def _start_apiserver(self, binary: Path, timeout: float) -> None:
        log = self.work_dir / "kube-apiserver.log"
        key = self.work_dir / "sa.key"
        if not key.exists():
            subprocess.run(
                ["openssl", "genrsa", "-out", str(key), "2048"],
                check=True, capture_output=True, umask=PRIVATE_UMASK,
            )  # fmt: skip
        tokens = self.work_dir / "tokens.csv"
        write_private(
            tokens,
            f'{self.admin_token},{ADMIN_USER},admin-uid,"system:masters"\n'
            f"{self.readonly_token},{READONLY_USER},readonly-uid\n",
        )
        self.apiserver = spawn(
            [
                str(binary),
                "--etcd-servers", self.etcd_url,
                "--cert-dir", str(self.work_dir / "certs"),
                "--secure-port", str(self.port),
                "--bind-address", "127.0.0.1",
                "--service-cluster-ip-range", "10.0.0.0/24",
                "--authorization-mode", "RBAC",
                "--disable-admission-plugins", "ServiceAccount",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-account-key-file", str(key),
                "--service-account-signing-key-file", str(key),
                "--token-auth-file", str(tokens),
                "--allow-privileged",
                *self.extra_args,
            ],
            log,
        )  # fmt: skip
        wait_until(
            lambda: port_open(self.port) and _http_ok(f"{self.url}/readyz", self.admin_token),
            process=self.apiserver, what="kube-apiserver", log_path=log, timeout=timeout,
        )  # fmt: skip

    def kubeconfig(self, token: str | None = None, user: str = ADMIN_USER) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "lapse",
                    # kube-apiserver self-signs its serving certificate into --cert-dir.
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.work_dir / "certs" / "apiserver.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "lapse", "context": {"cluster": "lapse", "user": user}}],
            "current-context": "lapse",
        }

    def _write_kubeconfig(self) -> None:
        write_private(self.kubeconfig_path, yaml.safe_dump(self.kubeconfig()))


def _http_ok(url: str, token: str | None = None) -> bool:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    # Loopback only, against a certificate the apiserver just signed for itself.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False
