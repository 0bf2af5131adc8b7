"""The servers the comparison benchmark runs against, and the only place bench/ reaches
into lapse's internals (its embedded launchers), so a restructure re-points one module.

lapse itself is driven as users drive it: `python -m lapse.cli ...` subprocesses.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml

from lapse.config import NatsConfig
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.edges.streams import configured_streams, ensure_streams
from lapse.edges.watch_positions import WatchPositions
from lapse.embedded.kube import (
    ARGO_MODULE,
    ARGO_WORKFLOWS_VERSION,
    KUBE_VERSION,
    EmbeddedKube,
    cache_root,
    go_module_dir,
    kube_binaries,
)
from lapse.embedded.nats import EmbeddedNats, nats_server_binary
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.functions.trust import Provenance

LAPSE_CLI = [sys.executable, "-m", "lapse.cli"]
BENCH_DIR = Path(__file__).resolve().parent
ARGO_BUILD_SCRIPT = BENCH_DIR / "build-argo.sh"
WORKFLOWS = "/apis/argoproj.io/v1alpha1"

__all__ = [
    "ARGO_WORKFLOWS_VERSION",
    "KUBE_VERSION",
    "LAPSE_CLI",
    "Api",
    "Stack",
    "argo_controller_binary",
    "argo_crds",
    "kube_binaries",
    "nats_server_binary",
    "rss_mib",
]


def argo_controller_binary(version: str = ARGO_WORKFLOWS_VERSION) -> Path:
    """Argo's workflow-controller, built once per version by bench/build-argo.sh."""
    env = {**os.environ, "LAPSE_ARGO_VERSION": version, "LAPSE_CACHE": str(cache_root())}
    out = subprocess.run(
        ["bash", str(ARGO_BUILD_SCRIPT)], env=env, check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1]) / "workflow-controller"


def argo_crds(version: str = ARGO_WORKFLOWS_VERSION) -> list[dict[str, Any]]:
    """Every CRD Argo installs (the `minimal` variants): its controller waits for all their
    informers before it deletes anything."""
    directory = go_module_dir(ARGO_MODULE, version) / "manifests/base/crds/minimal"
    return [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("argoproj.io_*.yaml"))]


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of a live process from /proc, in MiB (None once it has exited)."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: Metadata
    users: {users}
  - level: None
"""


@dataclass
class Stack:
    """etcd + kube-apiserver (lapse's embedded launcher) with one token user per tool,
    each in system:masters, and an audit log of those users' requests; plus nats-server."""

    work_dir: Path
    users: tuple[str, ...]
    tokens: dict[str, str] = field(default_factory=dict)
    kube: EmbeddedKube | None = None
    nats: EmbeddedNats | None = None

    @property
    def audit_log(self) -> Path:
        return self.work_dir / "audit.log"

    def start(self) -> Stack:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        admin = secrets.token_hex(16)
        self.tokens = {user: secrets.token_hex(16) for user in self.users}
        token_file = self.work_dir / "bench-tokens.csv"
        token_file.write_text(
            f'{admin},admin,admin-uid,"system:masters"\n'
            + "".join(
                f'{token},{user},{user}-uid,"system:masters"\n'
                for user, token in self.tokens.items()
            )
        )
        policy = self.work_dir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY.format(users=list(self.users)))
        # kube-apiserver takes the last of a repeated flag: this token file replaces the
        # launcher's own (which has the same admin token).
        self.kube = EmbeddedKube(
            self.work_dir / "kube",
            admin_token=admin,
            extra_args=(
                # The network namespace has no default route to pick an address from.
                "--advertise-address", "127.0.0.1",
                "--token-auth-file", str(token_file),
                "--audit-policy-file", str(policy),
                "--audit-log-path", str(self.audit_log),
                # In megabytes. 0 is not "never": the log rotates at lumberjack's default,
                # 100 MB, which a full run's 100,000-deletion phases pass, and a rotated
                # log would be read from the old offset (AuditLog refuses it).
                "--audit-log-maxsize", "1000000",
                "--audit-log-mode", "blocking",
            ),
        ).start()  # fmt: skip
        self.nats = EmbeddedNats(self.work_dir / "nats").start()
        return self

    def stop(self) -> None:
        if self.nats is not None:
            self.nats.stop()
        if self.kube is not None:
            self.kube.stop()

    @property
    def _kube(self) -> EmbeddedKube:
        assert self.kube is not None, "the stack is not started"
        return self.kube

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    @property
    def nats_monitor_url(self) -> str:
        assert self.nats is not None
        return self.nats.monitor_url

    @property
    def nats_pid(self) -> int | None:
        return self.nats.process.pid if self.nats and self.nats.process else None

    def server_pids(self) -> dict[str, int]:
        """The servers' processes by name (their CPU is measured beside a tool's)."""
        procs = {
            "kube-apiserver": self.kube.apiserver if self.kube else None,
            "etcd": self.kube.etcd if self.kube else None,
            "nats-server": self.nats.process if self.nats else None,
        }
        return {name: p.pid for name, p in procs.items() if p is not None}

    def kubeconfig_for(self, user: str, path: Path) -> Path:
        """A kubeconfig authenticating as `user` (a tool's own identity in the audit log)."""
        config = self._kube.kubeconfig(token=self.tokens[user], user=user)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def api(self, user: str | None = None) -> Api:
        """A client for the harness itself (the unaudited admin) or for a tool's user."""
        kube = self._kube
        token = kube.admin_token if user is None else self.tokens[user]
        return Api(kube.url, str(kube.work_dir / "certs" / "apiserver.crt"), token)


class Api:
    """A small thread-safe Kubernetes REST client (one HTTP connection pool per thread)."""

    def __init__(self, url: str, ca: str, token: str) -> None:
        self._url, self._ca, self._token = url, ca, token
        self._local = threading.local()

    @property
    def http(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(
                base_url=self._url,
                verify=self._ca,
                headers={"Authorization": f"Bearer {self._token}"},
                timeout=120,
            )
            self._local.client = client
        return client

    def apply(self, path: str, body: dict[str, Any]) -> None:
        """POST `body` to the collection at `path`; an existing object is left as it is."""
        response = self.http.post(path, json=body)
        if response.status_code != 409:
            response.raise_for_status()

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        response = self.http.get(path, params=params)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def workflows(self, namespace: str) -> str:
        return f"{WORKFLOWS}/namespaces/{namespace}/workflows"

    def list_all(self, path: str, label_selector: str = "") -> Iterator[dict[str, Any]]:
        token = ""
        while True:
            params: dict[str, Any] = {"limit": 1000, "labelSelector": label_selector}
            if token:
                params["continue"] = token
            page = self.get(path, **params)
            yield from page.get("items", [])
            token = page.get("metadata", {}).get("continue") or ""
            if not token:
                return

    def names(self, namespace: str, label_selector: str) -> set[str]:
        return {
            w["metadata"]["name"] for w in self.list_all(self.workflows(namespace), label_selector)
        }


def parallel(
    work: Callable[[Any], None], items: Iterable[Any], threads: int = 16
) -> tuple[int, float]:
    """Run `work` over `items` on `threads` threads: (items done, seconds taken)."""
    started = time.monotonic()
    done = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="bench") as pool:
        for _ in pool.map(work, items):
            done += 1
    return done, time.monotonic() - started


def install_argo(admin: Api, namespace: str) -> None:
    """Argo's CRDs and a namespace for the Workflows, served before this returns."""
    for crd in argo_crds():
        admin.apply("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    admin.apply("/api/v1/namespaces", {"metadata": {"name": namespace}})
    time.sleep(3)  # the CRD served


def start_lapse_up(stack: Stack, work: Path, settings: str = "") -> subprocess.Popen[bytes]:
    """`lapse up` as user `lapse` against the stack (watching Workflows only, no ingress),
    its log in work/lapse.log; returns once it says it is running. `settings`: more YAML."""
    config = work / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{stack.nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{stack.kubeconfig_for('lapse', work / 'kc')}'}}\n"
        "kinds: [argo-workflow]\n"
        + settings
        # A real cluster: lapse up deletes only where the namespaces are named.
        + ("" if "safety" in settings else "safety: {namespaces: {include: ['*']}}\n")
    )
    log = work / "lapse.log"
    lapse = subprocess.Popen(
        [*LAPSE_CLI, "--config", str(config), "up", "--state-dir", str(work / "state"),
         "--listen", ""],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OTEL_SDK_DISABLED": "true"},
    )  # fmt: skip
    while "lapse is running" not in log.read_text():
        if lapse.poll() is not None:
            raise SystemExit(f"lapse up exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return lapse


PUTS_IN_FLIGHT = 2000


def _pending_due_event(deadline: datetime) -> tuple[str, Any]:
    uid = str(uuid.uuid4())
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="pending", name=f"wf-{uid[:8]}", uid=uid, phase="Succeeded",
        finished_at=deadline - timedelta(days=30), annotations={"lapse.dev/ttl": "30d"},
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=deadline, policy="annotation",
        scheduled_at=datetime.now(UTC),
    )  # fmt: skip
    return uid, build_event(EventType.CLEANUP_DUE, source="/bench/pending", data=due)


async def put_pending(nats_url: str, count: int) -> float:
    """Put `count` more schedules, 30 days out, straight into lapse's schedule stream through
    its own ScheduleStore (due events for Workflows that do not exist): what a pending
    deletion costs lapse and NATS, without that many objects in etcd. Creates the streams
    if no lapse has yet. Returns puts per second."""
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        nats = NatsConfig()
        await ensure_streams(js, configured_streams(nats))
        store = NatsScheduleStore(js, nats.streams)
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(days=30)
        started = time.monotonic()
        for first in range(0, count, PUTS_IN_FLIGHT):
            batch = min(PUTS_IN_FLIGHT, count - first)
            events = [_pending_due_event(deadline) for _ in range(batch)]
            await asyncio.gather(
                *(
                    store.put(
                        Target.KUBERNETES, uid, deadline, event, provenance=Provenance.CLAIMED
                    )
                    for uid, event in events
                )
            )
        return count / max(time.monotonic() - started, 1e-6)
    finally:
        await nc.close()


async def forget_leftovers(nats_url: str, kinds: tuple[str, ...]) -> None:
    """After a capped drain whose leftover objects were removed, what lapse still held for
    them goes too: the run events it had not planned (purged), the due messages it had not
    reaped (`lapse.due.>` purged) and the stored watch positions of `kinds` (resuming would
    replay every removal as a deletion to plan). The next drain then starts with none of
    this one's work, as a first start does; the pending objects' schedules stay. Without
    it a drain capped before its end leaves tens of thousands of stale events ahead of the
    next phase's objects (the full run of 2026-11-26 deleted nothing in its scale-out)."""
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        streams = NatsConfig().streams
        await js.purge_stream(str(streams.events))
        await js.purge_stream(str(streams.schedule), subject="lapse.due.>")
        for kind in kinds:
            await WatchPositions(js).forget(kind)
    finally:
        await nc.close()


async def as_if_restarted_later(nats_url: str, forget_kinds: tuple[str, ...] = ()) -> None:
    """Make lapse's next start meet what a restart minutes later meets: every stream's
    duplicate window (2 min) let pass, so nothing it publishes again is dropped as a
    duplicate (shrunk, waited out, restored). `forget_kinds`: their stored watch positions
    forgotten too (a first start, or the API server no longer serving the version: 410)."""
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        configs = []
        for stream in configured_streams(NatsConfig()):
            info = await js.stream_info(str(stream.name))
            configs.append(info.config)
        for config in configs:
            window = config.duplicate_window
            config.duplicate_window = 0.5
            await js.update_stream(config)
            config.duplicate_window = window
        await asyncio.sleep(3)
        for config in configs:
            await js.update_stream(config)
        for kind in forget_kinds:
            await WatchPositions(js).forget(kind)
    finally:
        await nc.close()
