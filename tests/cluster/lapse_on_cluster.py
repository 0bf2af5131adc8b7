"""lapse deployed on the real cluster (issue 17), shared by the tests of tests/cluster: the
images `make images` builds pushed to the cluster's registry, the run CRDs, the Secret the
docs ask for, and `kubectl apply -k` of a kustomization made in a temporary folder over
`infra/overlays/dev` (the dev overlay is used unchanged, as its only resource):

- an `images:` list naming the pushed images;
- the object-reaper's autoscaling window, 6 s (so it scales to zero within a minute);
- lapse.yaml: the dev overlay's, plus the KFP database target and one policy giving the
  rows of KFP runs (label `pipeline/runid`) their own clock, `ROWS_TTL`;
- the database: the host's PostgreSQL (`make databases`), a scratch database holding KFP's
  tables, reached from pods through the Service `lapse-postgres` (no selector, one
  EndpointSlice) at the node's address, where `socat` relays to 127.0.0.1:5432: the host's
  PostgreSQL keeps listening on loopback only, its configuration untouched;
- OpenTelemetry: a Jaeger and a Collector (infra/otel/collector.yaml) in the namespace
  `observability`, and every lapse pod exporting to the Collector (the standard OTEL_*
  variables).

Deployed once per session, the first time a test asks for it (`lapse` in conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.engine import make_url

from lapse.edges.database import create_engine
from lapse.embedded.kube import run_kind_crds
from tests.cluster.conftest import REPO, Cluster, poll
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.observability import COLLECTOR_CONFIG, collector_overrides, jaeger_config
from tests.stack import Database

DEV_OVERLAY = REPO / "infra/overlays/dev"
SYSTEM = "lapse-system"
RUNS = "default"  # the namespace the dev overlay cleans
# A second namespace lapse cleans (lapse.yaml's safety.namespaces, the Roles the overlay
# makes for `default`) that the ApiServerSource does not watch: no event of a run there
# reaches the planner, so only the safety net plans it (test_safety_net_on_cluster.py).
UNWATCHED = "lapse-unwatched"
# Everything the install waits for after `kubectl apply` shares this budget (image pulls,
# Knative reconciling, NATS and the functions starting).
INSTALL_TIMEOUT = 360.0
REAPER = "lapse-object-reaper"
ROW_REAPER = "lapse-row-reaper"
PLANNER = "lapse-ttl-planner"
# The object-reaper's autoscaling window in this test (Knative's default is 60 s), so the
# scaled-to-zero case does not wait minutes.
REAPER_WINDOW = "6s"
# The rows of a KFP run (a Workflow labelled pipeline/runid) are deleted on this clock, the
# Workflow on its own lapse.dev/ttl.
ROWS_TTL = 45
POSTGRES_SERVICE = "lapse-postgres"
POSTGRES_PORT = 5432
OBSERVABILITY = "observability"
COLLECTOR_OTLP_HTTP = f"http://otel-collector.{OBSERVABILITY}.svc:4318"
JAEGER_QUERY_PORT = 16686
# What every lapse pod gets (the standard OTel SDK variables lapse reads,
# lapse/telemetry/providers.py): OTLP/HTTP to the in-cluster Collector, spans sent every
# half second rather than every 5 s.
OTEL_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR_OTLP_HTTP, "OTEL_BSP_SCHEDULE_DELAY": "500"}


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def finished_workflow(
    name: str, finished_at: datetime, ttl: str, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """A Workflow as Argo's controller leaves a finished one (no controller runs here)."""
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true", **(labels or {})},
            "annotations": {"lapse.dev/ttl": ttl},
        },
        "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {
            "image": "busybox", "command": ["true"]}}]},
        "status": {
            "phase": "Succeeded",
            "startedAt": rfc3339(finished_at - timedelta(seconds=3)),
            "finishedAt": rfc3339(finished_at),
        },
    }  # fmt: skip


class DeletionWatch:
    """`kubectl get --watch` on Workflows, or another `resource` (one by name, or a batch by
    label), started before they are created: records when each watch event arrived (host
    clock = node clock, one machine) and each object as the event carried it."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        name: str = "",
        *,
        selector: str = "",
        resource: str = "workflows.argoproj.io",
    ) -> None:
        which = ["--selector", selector] if selector else [
            "--field-selector", f"metadata.name={name}"]  # fmt: skip
        self.events: list[tuple[float, str, str]] = []  # (time.time(), type, uid)
        self.objects: dict[str, list[dict[str, Any]]] = {}  # uid -> as each event carried it
        self._process = subprocess.Popen(
            [
                cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, "-n", namespace,
                "get", resource, *which,
                "--watch", "--output-watch-events", "-o", "json",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self._process.stdout:
            buffer += line
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except json.JSONDecodeError:
                    break  # an object not complete yet
                buffer = buffer.lstrip()[end:]
                uid = event.get("object", {}).get("metadata", {}).get("uid", "")
                self.objects.setdefault(uid, []).append(event.get("object", {}))
                self.events.append((time.time(), event.get("type", ""), uid))

    def added(self, timeout: float = 30) -> None:
        poll("the watch saw an object added", lambda: self._seen("ADDED"), timeout, 0.1)

    def deleted_at(self, uid: str, timeout: float) -> float:
        found = poll(
            "the object deleted",
            lambda: next((t for t, kind, u in self.events if kind == "DELETED" and u == uid), 0),
            timeout,
            0.05,
        )
        return float(found)

    def deleted(self) -> dict[str, float]:
        """uid -> when its DELETED event arrived."""
        return {u: t for t, kind, u in list(self.events) if kind == "DELETED"}

    def _seen(self, kind: str) -> bool:
        return any(k == kind for _, k, _ in self.events)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


@dataclass
class Deployment:
    cluster: Cluster
    images: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    rows: KfpRows | None = None

    def pods(self, service: str) -> list[dict[str, Any]]:
        selector = f"serving.knative.dev/service={service}"
        out = self.cluster.kubectl("-n", SYSTEM, "get", "pods", "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return [p for p in items if "deletionTimestamp" not in p["metadata"]]

    def diagnosis(self) -> str:
        """What an engineer looks at first when the chain breaks (in failure messages)."""
        k = self.cluster.kubectl
        parts = [
            k("-n", SYSTEM, "get", "pods,deploy,job,ksvc,broker,trigger,apiserversource,"
              "sinkbinding", "-o", "wide", check=False),
            k("-n", SYSTEM, "get", "events", "--sort-by=.lastTimestamp", check=False)[-3000:],
        ]  # fmt: skip
        for selector, container in (
            ("serving.knative.dev/service=lapse-ttl-planner", "function"),
            (f"serving.knative.dev/service={REAPER}", "function"),
            ("app.kubernetes.io/name=lapse-bridge", "bridge"),
        ):
            logs = k("-n", SYSTEM, "logs", "-l", selector, "-c", container, "--tail=25",
                     check=False)  # fmt: skip
            parts.append(f"--- logs {selector}\n{logs}")
        return "\n".join(parts)


def unwatched_namespace(rendered: str) -> list[dict[str, Any]]:
    """UNWATCHED and what the overlay grants lapse in RUNS (infra/access/knative: the
    reader Role with the planner's and the policy watcher's ServiceAccounts, the
    object-reaper's Role), placed there; the ApiServerSource's selector is left alone."""
    items: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": UNWATCHED}}
    ]
    for item in yaml.safe_load_all(rendered):
        ours = item and item["kind"] in ("Role", "RoleBinding")
        if ours and item["metadata"].get("namespace") == RUNS:
            items.append({**item, "metadata": {**item["metadata"], "namespace": UNWATCHED}})
    assert len(items) > 2, f"no Role of lapse in the rendered overlay's namespace {RUNS}"
    return items


def kubectl_waiting(cluster: Cluster, *args: str, timeout: float) -> None:
    """`kubectl wait` or `rollout status` given `timeout` (Cluster.kubectl stops at 120 s)."""
    command = [cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, *args]
    result = subprocess.run(
        [*command, f"--timeout={int(timeout)}s"],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")


def kubectl_apply_retrying(cluster: Cluster, *args: str, stdin: str | None = None) -> None:
    """Knative's webhooks refuse objects for a moment after they start: retry a little."""
    for attempt in range(8):
        try:
            cluster.kubectl("apply", *args, stdin=stdin)
            return
        except AssertionError:
            if attempt == 7:
                raise
            time.sleep(5)


def push_images() -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/cluster/push-lapse-images.py")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"push-lapse-images.py: {result.stderr[-3000:]}"
    images: dict[str, str] = json.loads(result.stdout)
    return images


class PostgresRelay:
    """The host's PostgreSQL (loopback only) reachable from pods: `socat` listening on the
    node's address relays each connection to 127.0.0.1:5432. PostgreSQL sees loopback
    clients, so neither its listen address nor pg_hba.conf changes; stopping the relay
    leaves the host as it was."""

    def __init__(self, node_ip: str, admin_url: str) -> None:
        url = make_url(admin_url)
        self.node_ip = node_ip
        self.target = (url.host or "127.0.0.1", url.port or 5432)
        self.port = _free_port(node_ip)
        socat = shutil.which("socat")
        assert socat, "socat is needed (Debian package socat; scripts/cluster/start.sh installs it)"
        self._process = subprocess.Popen(
            [socat, f"TCP-LISTEN:{self.port},bind={node_ip},reuseaddr,fork",
             f"TCP:{self.target[0]}:{self.target[1]}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own group: stop() ends the forked relays too
        )  # fmt: skip
        poll("socat listening", self._listening, timeout=10, interval=0.1)

    def _listening(self) -> bool:
        if self._process.poll() is not None:
            error = self._process.stderr.read() if self._process.stderr else ""
            raise AssertionError(f"socat exited: {error}")
        try:
            socket.create_connection((self.node_ip, self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def manifests(self) -> list[dict[str, Any]]:
        """A Service without selector and its one EndpointSlice: the relay, by name."""
        return [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": POSTGRES_SERVICE, "namespace": SYSTEM},
             "spec": {"ports": [{"name": "postgres", "port": POSTGRES_PORT,
                                 "targetPort": self.port}]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"{POSTGRES_SERVICE}-host", "namespace": SYSTEM,
                          "labels": {"kubernetes.io/service-name": POSTGRES_SERVICE}},
             "addressType": "IPv4",
             "ports": [{"name": "postgres", "port": self.port, "protocol": "TCP"}],
             "endpoints": [{"addresses": [self.node_ip]}]},
        ]  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGTERM)
        self._process.wait(timeout=10)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class KfpRows:
    """KFP's run tables in the session's scratch database on the host's PostgreSQL."""

    def __init__(self, database: Database) -> None:
        self.url = database.url

    def _run(self, work: Any) -> Any:
        async def session() -> Any:
            engine = create_engine(self.url, pool_size=1)
            try:
                return await work(engine)
            finally:
                await engine.dispose()

        return asyncio.run(session())

    def create_tables(self) -> None:
        self._run(create_kfp_tables)

    def insert_run(self, run_id: str) -> None:
        async def work(engine: Any) -> None:
            async with engine.begin() as conn:
                await insert_kfp_runs(conn, [run_id], namespace=RUNS)

        self._run(work)

    def counts(self, run_id: str) -> dict[str, int]:
        async def work(engine: Any) -> dict[str, int]:
            async with engine.connect() as conn:
                return await kfp_counts(conn, run_id)

        counts: dict[str, int] = self._run(work)
        return counts

    def url_for_pods(self) -> str:
        """The same database by the Service name (the relay behind it)."""
        url = make_url(self.url).set(host=f"{POSTGRES_SERVICE}.{SYSTEM}.svc", port=POSTGRES_PORT)
        return url.render_as_string(hide_password=False)


def observability_images() -> dict[str, str]:
    """The Collector and Jaeger images (scripts/cluster/build-images.sh observability: the
    binaries of `make observability`, cached), imported into the cluster's containerd."""
    built = subprocess.run(
        ["bash", str(REPO / "scripts/cluster/build-images.sh"), "observability"],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert built.returncode == 0, f"build-images.sh observability: {built.stderr[-3000:]}"
    folder = Path(built.stdout.split()[-1])
    imported = subprocess.run(
        ["bash", str(REPO / "scripts/cluster/import-images.sh")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert imported.returncode == 0, f"import-images.sh: {imported.stderr[-3000:]}"
    lines = (folder / "observability.refs").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines)


def observability_manifests(images: dict[str, str]) -> list[dict[str, Any]]:
    """Jaeger (in-memory storage, its query API read by the test) and a Collector running
    the shipped infra/otel/collector.yaml with its traces sent to that Jaeger: the setup of
    tests/e2e/test_real_backends.py, in pods."""
    overrides = collector_overrides(
        otlp_http="0.0.0.0:4318", otlp_grpc="0.0.0.0:4317", prometheus="0.0.0.0:8889",
        health="0.0.0.0:13133", traces_endpoint=f"jaeger.{OBSERVABILITY}.svc:4317",
    )  # fmt: skip
    jaeger = jaeger_config(
        otlp_grpc="0.0.0.0:4317", otlp_http="0.0.0.0:4318",
        query_http=f"0.0.0.0:{JAEGER_QUERY_PORT}", query_grpc="0.0.0.0:16685",
    )  # fmt: skip

    def workload(
        name: str, service: str, args: list[str], ports: dict[str, int],
        ready: tuple[str, int], config: dict[str, str],
    ) -> list[dict[str, Any]]:  # fmt: skip
        labels = {"app.kubernetes.io/name": name}
        return [
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": name, "namespace": OBSERVABILITY}, "data": config},
            {"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": name, "namespace": OBSERVABILITY},
             "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": {
                          "automountServiceAccountToken": False,
                          "containers": [{
                              "name": name, "image": images[name], "args": args,
                              "ports": [{"name": k, "containerPort": v}
                                        for k, v in ports.items()],
                              "readinessProbe": {"httpGet": {"path": ready[0],
                                                             "port": ready[1]}},
                              "volumeMounts": [{"name": "config", "mountPath": "/etc/config"}],
                          }],
                          "volumes": [{"name": "config", "configMap": {"name": name}}],
                      }}}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": service, "namespace": OBSERVABILITY},
             "spec": {"selector": labels,
                      "ports": [{"name": k, "port": v, "targetPort": v}
                                for k, v in ports.items()]}},
        ]  # fmt: skip

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OBSERVABILITY}},
        *workload(
            "jaeger", "jaeger", ["--config", "/etc/config/jaeger.yaml"],
            {"otlp-grpc": 4317, "otlp-http": 4318, "query": JAEGER_QUERY_PORT},
            ("/api/v3/services", JAEGER_QUERY_PORT), {"jaeger.yaml": yaml.safe_dump(jaeger)},
        ),
        *workload(
            "otelcol-lapse", "otel-collector",
            ["--config=/etc/config/collector.yaml", "--config=/etc/config/overrides.yaml"],
            {"otlp-http": 4318, "otlp-grpc": 4317}, ("/", 13133),
            {"collector.yaml": COLLECTOR_CONFIG.read_text(),
             "overrides.yaml": yaml.safe_dump(overrides)},
        ),
    ]  # fmt: skip


def otel_env_patch() -> list[dict[str, Any]]:
    return [
        {"op": "add", "path": "/spec/template/spec/containers/0/env/-",
         "value": {"name": name, "value": value}}
        for name, value in OTEL_ENV.items()
    ]  # fmt: skip


def lapse_yaml() -> str:
    """The dev overlay's lapse.yaml with the KFP target, the rows' own clock, and
    UNWATCHED cleaned too."""
    config = yaml.safe_load((DEV_OVERLAY / "lapse.yaml").read_text())
    config["database"] = {"targets": {"kfp": {"enabled": True}}}
    config["safety"]["namespaces"]["include"] = [RUNS, UNWATCHED]
    config["policies"] = [
        {
            "name": "kfp-rows",
            "match": {"has_labels": ["pipeline/runid"]},
            "database": {"ttl": f"{ROWS_TTL}s"},
        }
    ]
    return yaml.safe_dump(config, sort_keys=False)


def overlay_for(
    folder: Path, images: dict[str, str], *, extra: tuple[str, ...] = (), config: str | None = None
) -> Path:
    """The dev overlay with the pushed images, the test's reaper window and lapse.yaml
    (`config`, else lapse_yaml())."""
    window_patch = [
        {
            "op": "add",
            "path": "/spec/template/metadata/annotations/autoscaling.knative.dev~1window",
            "value": REAPER_WINDOW,
        }
    ]
    (folder / "lapse.yaml").write_text(lapse_yaml() if config is None else config)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes no absolute path: the dev overlay relative to this folder
        "resources": [os.path.relpath(DEV_OVERLAY, folder), *extra],
        "images": [
            {"name": name, "newName": ref.rsplit(":", 1)[0], "newTag": ref.rsplit(":", 1)[1]}
            for name, ref in sorted(images.items())
        ],
        "configMapGenerator": [
            {
                "name": "lapse",
                "namespace": SYSTEM,
                "behavior": "merge",
                "files": ["lapse.yaml"],
            }
        ],
        # `lapse` is a name func.yaml and the pods reference: no hash suffix (as in base).
        "generatorOptions": {"disableNameSuffixHash": True},
        "patches": [
            {
                "target": {"group": "serving.knative.dev", "kind": "Service", "name": REAPER},
                "patch": json.dumps(window_patch),
            },
            # Every function and the bridge export their spans to the in-cluster Collector.
            {
                "target": {"group": "serving.knative.dev", "kind": "Service"},
                "patch": json.dumps(otel_env_patch()),
            },
            {
                "target": {"kind": "Deployment", "name": "lapse-bridge"},
                "patch": json.dumps(otel_env_patch()),
            },
        ],
    }
    (folder / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2))
    return folder


def deploy(
    cluster: Cluster, folder: Path, database: Database, admin_url: str, *, config: str | None = None
) -> tuple[Deployment, PostgresRelay]:
    """lapse installed (module docstring); `config` replaces lapse_yaml() (bench_knative.py)."""
    started = time.monotonic()
    images = push_images()
    deployment = Deployment(cluster, images)
    deployment.timings["images"] = time.monotonic() - started
    names = ("lapse", "ttl-planner", "object-reaper", "row-reaper")
    assert {f"dev.local/lapse/{n}" for n in names} <= set(images), images

    # The run CRDs the ApiServerSource watches (Argo's Workflow is the one these tests use).
    items: list[dict[str, Any]] = list(run_kind_crds())
    crds = {"apiVersion": "v1", "kind": "List", "items": items}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(crds))
    for crd in items:
        name = crd["metadata"]["name"]
        cluster.kubectl("wait", f"crd/{name}", "--for=condition=Established", "--timeout=60s")

    # KFP's tables before the row-reaper starts (it checks them), and the way to them.
    rows = KfpRows(database)
    rows.create_tables()
    relay = PostgresRelay(cluster.node_ip, admin_url)
    deployment.rows = rows
    try:
        _install(deployment, folder, rows, relay, started, config)
    except BaseException:
        relay.stop()  # whatever failed, no relay outlives the session
        raise
    return deployment, relay


def _install(
    deployment: Deployment,
    folder: Path,
    rows: KfpRows,
    relay: PostgresRelay,
    started: float,
    config: str | None = None,
) -> None:
    """Everything of `deploy` after the relay started (so `deploy` stops it on failure)."""
    cluster, images = deployment.cluster, deployment.images
    # The Secret docs/deploy.md asks users to create: the database URL. The NATS passwords
    # (lapse-nats-users) are made in the cluster by the dev NATS's Job.
    # (Applied, not created: a second run on the same cluster finds them.)
    objects = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM}},
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "lapse-database", "namespace": SYSTEM},
                "stringData": {"url": rows.url_for_pods()},
            },
            *relay.manifests(),
        ],
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(objects))

    # The Collector and Jaeger first: the functions export to them from their start.
    observability = observability_manifests(observability_images())
    cluster.kubectl(
        "apply", "-f", "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": observability}),
    )  # fmt: skip

    overlay = overlay_for(folder, images, config=config)
    rendered = cluster.kubectl("kustomize", str(overlay))
    for name, ref in images.items():
        assert name not in rendered.replace(ref, ""), f"{name} left in the rendered overlay"
    # Before the policy watcher starts, so its first pass may read there.
    unwatched = {"apiVersion": "v1", "kind": "List", "items": unwatched_namespace(rendered)}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(unwatched))
    # Run again on a running cluster with another build: a Job's template cannot change,
    # so the dev NATS's password Job is made anew (it creates only what is missing). The
    # streams are a Deployment that an upgrade rolls (infra/base/streams.yaml).
    cluster.kubectl(
        "-n", SYSTEM, "delete", "job", "lapse-nats-users", "--ignore-not-found"
    )  # fmt: skip
    kubectl_apply_retrying(cluster, "-k", str(overlay))
    deployment.timings["applied"] = time.monotonic() - started
    until = time.monotonic() + INSTALL_TIMEOUT

    def left() -> float:
        return max(until - time.monotonic(), 5)

    try:
        kubectl_waiting(
            cluster, "-n", SYSTEM, "rollout", "status", "deploy/lapse-streams", timeout=left()
        )  # fmt: skip
        for ready in ("broker/lapse", "sinkbinding/lapse-bridge", f"ksvc/{PLANNER}",
                      f"ksvc/{REAPER}", f"ksvc/{ROW_REAPER}",
                      "trigger/ttl-planner", "trigger/object-reaper-due",
                      "trigger/row-reaper-due", "apiserversource/lapse-workflows",
                      "eventpolicy/lapse-broker"):  # fmt: skip
            cluster.wait_ready(SYSTEM, ready, timeout=left())
        # After the SinkBinding gave the bridge its K_SINK (a new rollout), every
        # Deployment available.
        for name in ("nats", "lapse-bridge", "lapse-dlq-sink"):
            kubectl_waiting(
                cluster, "-n", SYSTEM, "rollout", "status", f"deploy/{name}", timeout=left()
            )
        for name in ("jaeger", "otelcol-lapse"):
            kubectl_waiting(
                cluster, "-n", OBSERVABILITY, "rollout", "status", f"deploy/{name}",
                timeout=left(),
            )  # fmt: skip
        bridge = cluster.get(SYSTEM, "deploy/lapse-bridge")["spec"]["template"]["spec"]
        assert any(e["name"] == "K_SINK" for e in bridge["containers"][0].get("env", [])), bridge
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{deployment.diagnosis()}") from None
    deployment.timings["ready"] = time.monotonic() - started
    print(
        "\nlapse deployed: images pushed in {images:.0f} s, applied at {applied:.0f} s, "
        "everything Ready at {ready:.0f} s".format(**deployment.timings)
    )


@dataclass
class Written:
    """A finished Workflow written with `lapse.dev/ttl`, watched until it is deleted."""

    deployment: Deployment
    ttl_seconds: int
    prefix: str
    name: str = ""
    uid: str = ""
    deadline: float = 0.0
    created_at: float = 0.0
    deleted_at: float = 0.0
    reaper_pods_at_deadline: int = -1
    watch: DeletionWatch | None = None
    labels: dict[str, str] = field(default_factory=dict)
    finished_at: datetime | None = None
    namespace: str = RUNS

    def write(self) -> Written:
        cluster = self.deployment.cluster
        self.name = f"{self.prefix}-{uuid.uuid4().hex[:8]}"
        self.watch = DeletionWatch(cluster, self.namespace, self.name)
        time.sleep(1)  # the watch is established (its first list comes back empty)
        self.finished_at = finished_at = datetime.now(UTC).replace(microsecond=0)
        workflow = finished_workflow(
            self.name, finished_at, f"{self.ttl_seconds}s", labels=self.labels
        )
        created = json.loads(
            cluster.kubectl(
                "-n", self.namespace, "create", "-o", "json", "-f", "-", stdin=json.dumps(workflow)
            )
        )
        self.created_at = time.time()
        self.uid = created["metadata"]["uid"]
        self.deadline = (finished_at + timedelta(seconds=self.ttl_seconds)).timestamp()
        self.watch.added()
        return self

    @property
    def lateness(self) -> float:
        return self.deleted_at - self.deadline

    def deleted(self) -> Written:
        """Wait for the deletion; fails if it comes before the deadline or never."""
        assert self.watch is not None
        try:
            # Until the deadline the Workflow must stay; look at the reaper just before it.
            while time.time() < self.deadline - 1.5:
                assert not any(k == "DELETED" for _, k, _ in self.watch.events), (
                    f"{self.name} deleted {self.deadline - time.time():.1f} s before its deadline"
                )
                time.sleep(0.2)
            self.reaper_pods_at_deadline = len(self.deployment.pods(REAPER))
            try:
                self.deleted_at = self.watch.deleted_at(
                    self.uid, timeout=max(self.deadline - time.time(), 0) + 120
                )
            except AssertionError as exc:
                still = self.deployment.cluster.kubectl(
                    "-n", self.namespace, "get", "workflow", self.name, "--ignore-not-found",
                    "-o", "name",
                    check=False,
                )  # fmt: skip
                when = rfc3339(datetime.fromtimestamp(self.deadline, UTC))
                raise AssertionError(
                    f"{exc}: {self.name} (uid {self.uid}, deadline {when})"
                    f" {'still exists' if still else 'is gone, but no DELETED event was seen'}\n"
                    f"{self.deployment.diagnosis()}"
                ) from None
        finally:
            self.watch.stop()
        assert self.lateness >= 0, f"{self.name} deleted {-self.lateness:.2f} s before its deadline"
        return self
