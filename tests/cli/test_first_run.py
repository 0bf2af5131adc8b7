"""A first `lapse up` never touches a real cluster by surprise: an ambient kubeconfig is not
a choice of cluster, and a real cluster chosen without `safety.namespaces.include` runs in
dry-run. The start-up line says which cluster, namespaces and kinds."""

from __future__ import annotations

import ipaddress
import json
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes import load_api_client
from lapse.embedded.kube import cache_root
from lapse.embedded.process import free_port
from tests.cli.conftest import LAPSE, Shell
from tests.conftest import KubeStack
from tests.stack import expired_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]

STARTUP = "cluster https://"
KUBE_CACHE = str(cache_root())
ROOT = Path(__file__).resolve().parents[2]


def listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port` (from /proc/net/tcp and
    tcp6): `127.0.0.1`, `0.0.0.0`, `::`."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(words)))
    return found


def first_run_claims() -> tuple[list[str], set[str]]:
    """What README.md says a first `lapse up` logs before its cluster line (the quoted
    beginnings of those lines), and what docs/install.md's table says stays in the state
    directory."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What the first run touches") :]
    said = " ".join(section[: section.index("\n## ", 1)].split())
    listed = re.search(r"one line each \(([^)]*)\)", said)
    assert listed is not None, "README: the first run's lines are not listed"
    before = re.findall(r"`([^`]+)`", listed.group(1))
    install = (ROOT / "docs" / "install.md").read_text()
    table = install[install.index("### What `make run` leaves") :]
    table = table[: table.index("### ", 5)]
    kept = set(re.findall(r"^\| `([^`]+?)/?` \|", table, flags=re.M))
    return before, kept


def poll(what: str, check: Callable[[], Any], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout}s")


class Up:
    def __init__(self, shell: Shell, log: Path, *args: str, env: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [*LAPSE, "up", "--listen", "", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                # The shell's HOME is the test's: keep the machine's built kube-apiserver.
                env={**shell.env, "LAPSE_CACHE": KUBE_CACHE, **env},
                cwd=shell.home,
            )

    def text(self) -> str:
        return self.log.read_text()

    def line(self, needle: str) -> str:
        def found() -> str | None:
            if self.process.poll() is not None:
                raise AssertionError(f"lapse up exited:\n{self.text()[-3000:]}")
            return next((ln for ln in self.text().splitlines() if needle in ln), None)

        line: str = poll(f"{needle!r} in lapse up's log", found, timeout=180)
        return line

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=60)


@pytest.fixture
def up_processes() -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for up in started:
        if up.process.poll() is None:
            up.stop()


def _workflow(name: str) -> dict[str, Any]:
    return expired_workflow(name, datetime.now(UTC) - timedelta(hours=1))


def _create(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    core = client.CoreV1Api(api)
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    except ApiException as exc:
        if exc.status != 409:
            raise
    objects = client.CustomObjectsApi(api)
    created: dict[str, Any] = objects.create_namespaced_custom_object(
        "argoproj.io", "v1alpha1", namespace, "workflows", body
    )
    return created


def _exists(api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            "argoproj.io", "v1alpha1", namespace, "workflows", name
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_up_ignores_an_ambient_kubeconfig(
    shell: Shell, kube: KubeStack, tmp_path: Path, up_processes: list[Up]
) -> None:
    # kubectl points at a "real" cluster; a finished Workflow there is long overdue.
    namespace = f"ambient-{uuid.uuid4().hex[:6]}"
    ambient = _create(kube.api_client, namespace, _workflow("must-stay"))
    listen = f"127.0.0.1:{free_port()}"
    up = Up(
        shell, tmp_path / "up.log", "--listen", listen, env={"KUBECONFIG": str(kube.kubeconfig)}
    )
    up_processes.append(up)

    line = up.line(STARTUP)
    # README's claim: before this line, only the lines about the servers lapse up started.
    before, kept = first_run_claims()
    earlier = up.text()[: up.text().index(line)].splitlines()
    assert earlier and all(ln.split(": ", 1)[1].startswith(tuple(before)) for ln in earlier), (
        before,
        earlier,
    )
    embedded_config = Path((shell.state_dir / "kubeconfig.path").read_text().strip())
    embedded_url = yaml.safe_load(embedded_config.read_text())["clusters"][0]["cluster"]["server"]
    assert embedded_url != kube.server.url
    assert f"cluster {embedded_url} (context lapse, the embedded kube-apiserver)" in line
    assert "namespaces *;" in line and "kinds argo-workflow," in line
    assert line.endswith("deleting (not dry-run)")
    assert kube.server.url not in up.text()
    assert f"{kube.kubeconfig} is not used without --kubeconfig" in up.text()

    # Something that would also have happened in the ambient cluster: an expired Workflow
    # in lapse up's own cluster is deleted.
    embedded = load_api_client(str(embedded_config))
    try:
        up.line("lapse is running")
        _create(embedded, "default", _workflow("goes"))
        poll(
            "the embedded cluster's Workflow deleted",
            lambda: not _exists(embedded, "default", "goes"),
        )
    finally:
        embedded.close()
    # The operator's log: a timestamp on every line of lapse's, one line per deletion, and
    # no false "CRD is not installed?" (the embedded CRDs are served before the watchers).
    # hypercorn's line in lapse's format, once (its own handler printed it a second time).
    served = [ln for ln in up.text().splitlines() if f"Running on http://{listen}" in ln]
    assert len(served) == 1, served
    assert re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z INFO hypercorn.error: Running on", served[0])
    # A read-only command asks the cluster lapse up uses, not the ambient one, and says so.
    plan = shell("plan", "-o", "json", env={"KUBECONFIG": str(kube.kubeconfig)})
    assert plan.returncode == 0, plan.stderr
    assert "must-stay" not in plan.stdout
    said = [ln for ln in plan.stderr.splitlines() if str(embedded_config) in ln]
    assert len(said) == 1 and f"not $KUBECONFIG ({kube.kubeconfig})" in said[0], plan.stderr
    deleted = up.line("deleted Workflow default/goes")
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO lapse.deletions: ", deleted)
    assert "target kubernetes, policy annotation:lapse.dev/ttl, " in deleted
    assert re.search(r"\d+\.\d{3}s late\)$", deleted)
    assert "not installed" not in up.text()
    version = shell("version", "-o", "json")
    assert version.returncode == 0, version.stderr
    assert json.loads(version.stdout)["up"]["pid"] == up.process.pid
    assert _exists(kube.api_client, namespace, "must-stay")
    current = client.CustomObjectsApi(kube.api_client).get_namespaced_custom_object(
        "argoproj.io", "v1alpha1", namespace, "workflows", "must-stay"
    )
    assert current["metadata"]["uid"] == ambient["metadata"]["uid"]
    assert up.stop() == 0, up.text()[-3000:]
    # docs/install.md's table of what stays in the state directory is what stayed.
    built = "started an S3 server" in up.text()
    expected = kept if built else kept - {"seaweedfs"}
    assert {p.name for p in shell.state_dir.iterdir()} == expected


def test_a_real_cluster_without_namespaces_is_dry_run(
    shell: Shell, kube: KubeStack, tmp_path: Path, up_processes: list[Up]
) -> None:
    namespace = f"dry-{uuid.uuid4().hex[:6]}"
    created = _create(kube.api_client, namespace, _workflow("kept-by-dry-run"))
    uid = created["metadata"]["uid"]
    metrics = free_port()
    up = Up(
        shell,
        tmp_path / "up.log",
        "--kubeconfig",
        str(kube.kubeconfig),
        "--listen",
        f"127.0.0.1:{free_port()}",
        env={"LAPSE_LOG_FORMAT": "json", "LAPSE_PROMETHEUS_PORT": str(metrics)},
    )
    up_processes.append(up)

    start = json.loads(up.line(STARTUP))
    assert start["level"] == "WARNING" and start["logger"] == "lapse"
    line = start["message"]
    assert f"cluster {kube.server.url} (context lapse, a real cluster)" in line
    assert "DRY-RUN" in line and "safety.namespaces.include" in line

    # The reaper judged it (its deadline passed) and deleted nothing.
    def judged() -> bool:
        result = shell("history", "-o", "json", "-n", namespace)
        assert result.returncode == 0, result.stderr
        return any(
            e.get("uid") == uid and e.get("outcome") == "dry_run"
            for e in json.loads(result.stdout)["items"]
        )

    poll("a dry_run outcome in history", judged)
    logged = json.loads(up.line(f"would delete (dry-run) Workflow {namespace}/kept-by-dry-run"))
    assert logged["uid"] == uid and logged["kind"] == "Workflow"
    assert logged["policy"] == "annotation:lapse.dev/ttl" and logged["lateness_seconds"] > 0
    assert _exists(kube.api_client, namespace, "kept-by-dry-run")
    # Metrics no further than the ingress: loopback, not every address.
    assert listening(metrics) == {"127.0.0.1"}
    assert up.stop() == 0, up.text()[-3000:]
    # Every line a JSON object: lapse's, the HTTP server's, the shutdown's.
    lines = up.text().splitlines()
    assert any("Running on http://127.0.0.1:" in ln for ln in lines)
    for ln in lines:
        assert isinstance(json.loads(ln), dict), ln


def test_reconcile_refuses_an_ambient_kubeconfig(shell: Shell, kube: KubeStack) -> None:
    result = shell("reconcile", "--dry-run", env={"KUBECONFIG": str(kube.kubeconfig)})
    assert result.returncode == 2, result.stderr
    assert "no cluster chosen" in result.stderr
    assert str(kube.kubeconfig) in result.stderr


def test_a_missing_kubeconfig_names_its_path(shell: Shell, tmp_path: Path) -> None:
    missing = tmp_path / "gone.yaml"
    by_env = shell("plan", env={"KUBECONFIG": str(missing)})
    assert by_env.returncode == 2
    assert f"$KUBECONFIG {missing}: file not found" in by_env.stderr
    by_config = shell("plan", env={"LAPSE_KUBERNETES__KUBECONFIG": str(missing)})
    assert by_config.returncode == 2
    assert f"kubeconfig file {missing} not found" in by_config.stderr
    # A command that needs no cluster is not stopped by it.
    status = shell("status", env={"LAPSE_KUBERNETES__KUBECONFIG": str(missing)})
    assert status.returncode == 2 and "nats.url is not set" in status.stderr
