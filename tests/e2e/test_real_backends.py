"""`lapse up` seen through a real OpenTelemetry Collector, Prometheus and Jaeger.

lapse runs as users run it (a subprocess) with OTEL_EXPORTER_OTLP_ENDPOINT pointing at the
Collector (infra/otel/collector.yaml; once over OTLP/HTTP, once over OTLP/gRPC), which
sends traces to Jaeger v2 and serves metrics to Prometheus; Prometheus also scrapes
lapse's own /metrics (LAPSE_PROMETHEUS_PORT). Real NATS, kube-apiserver and PostgreSQL
underneath.

Two waves of Workflows (each with a KFP run, its rows and its artifacts in a SeaweedFS S3
server) are deleted; in the second, a row lock held by the test makes the row-reaper retry
twice. Then:
- Jaeger's query API returns the first KFP run's planner trace and both reaper traces,
  linked as in tests/e2e/test_observability.py (in-memory exporters);
- every Prometheus panel query of infra/otel/grafana-dashboard.json runs through
  Prometheus's HTTP API, with the dashboard's variables substituted, once per path the
  metrics took (job "lapse" through the Collector, job "lapse-scrape" scraped directly),
  and returns data that agrees with the ground truth: the audit trail (`lapse history`),
  `lapse status`, lapse's log and the traces in Jaeger;
- the lateness exemplars Prometheus scraped from the Collector name the reaper span of the
  deletion they measured;
- the alert rules load into that Prometheus and none fires.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from lapse import infra
from lapse.edges.database import create_engine
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from tests.conftest import ARTIFACT_BUCKET, KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json, write_config
from tests.integration.test_artifact_reaper import client, plant, present
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts, run_details
from tests.observability import Binaries, Collector, Jaeger, Prometheus, binaries, loopback
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db, pytest.mark.observability]

DASHBOARD = json.loads(infra.read_text("otel/grafana-dashboard.json"))
# The two paths lapse's metrics take into Prometheus, by the job label they arrive with.
VIA_COLLECTOR = "lapse"  # OTLP -> Collector -> its Prometheus exporter (job = service.name)
SCRAPED = "lapse-scrape"  # Prometheus scrapes lapse's own /metrics
JOBS = (VIA_COLLECTOR, SCRAPED)
ARTIFACTS_PER_RUN = 3
LATENESS_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@pytest.fixture(scope="module")
def tools() -> Binaries:
    return binaries()


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: `lapse up` watches every namespace.
    with kube_stack(tmp_path_factory.mktemp("kube-otel")) as stack:
        yield stack


@pytest.fixture(scope="module")
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        name = engine.url.database
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            # A delete that meets the test's row lock fails fast (SQLSTATE 55P03) instead of
            # waiting: the row-reaper treats that as transient and retries.
            await conn.execute(text(f"ALTER DATABASE {name} SET lock_timeout = '500ms'"))
        await engine.dispose()
        yield db


@dataclass
class Backends:
    jaeger: Jaeger
    collector: Collector
    prometheus: Prometheus
    lapse_metrics_port: int


@pytest.fixture
def backends(tools: Binaries, tmp_path: Path) -> Iterator[Backends]:
    started: list[Jaeger | Collector | Prometheus] = []
    try:
        jaeger = Jaeger(tools.jaeger, tmp_path / "jaeger")
        jaeger.start()
        started.append(jaeger)
        collector = Collector(
            tools.otelcol, tmp_path / "otelcol", traces_endpoint=loopback(jaeger.otlp_grpc)
        )
        collector.start()
        started.append(collector)
        lapse_port = free_port()
        prometheus = Prometheus(
            tools.prometheus,
            tmp_path / "prometheus",
            {"otel-collector": loopback(collector.prometheus), SCRAPED: loopback(lapse_port)},
            honor_labels=frozenset({"otel-collector"}),
        )
        prometheus.start()
        started.append(prometheus)
        yield Backends(jaeger, collector, prometheus, lapse_port)
    finally:
        for server in reversed(started):
            server.stop()


class TelemetryLapseUp(LapseUp):
    """`lapse up` with the OTEL_* / LAPSE_PROMETHEUS_* environment a user would set."""

    def __init__(self, config: Path, state_dir: Path, log: Path, env: dict[str, str]) -> None:
        super().__init__(config, state_dir, log)
        self.env = env

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        await wait_for(self._running, timeout=60)


# --- traces as Jaeger returns them (OTLP JSON) ----------------------------------------------

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _id(value: str | None) -> str:
    """A trace or span id as lowercase hex (OTLP JSON says hex; protobuf JSON says base64)."""
    if not value:
        return ""
    if re.fullmatch(r"[0-9a-fA-F]{16}|[0-9a-fA-F]{32}", value):
        return value.lower()
    return base64.b64decode(value).hex()


def _value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    return value


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {item["key"]: _value(item.get("value", {})) for item in items or []}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    service: str
    attributes: dict[str, Any] = field(hash=False)
    links: tuple[Link, ...] = ()


def spans_of(traces: dict[str, Any]) -> list[Span]:
    found = []
    for resource in traces.get("resourceSpans", []):
        service = _attributes(resource.get("resource", {}).get("attributes")).get("service.name")
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                kind = span.get("kind", 1)
                kind = KINDS.get(kind, str(kind)) if isinstance(kind, int) else kind
                found.append(
                    Span(
                        _id(span["traceId"]),
                        _id(span["spanId"]),
                        _id(span.get("parentSpanId")),
                        span["name"],
                        str(kind).removeprefix("SPAN_KIND_"),
                        str(service),
                        _attributes(span.get("attributes")),
                        tuple(
                            Link(
                                _id(link["traceId"]),
                                _id(link["spanId"]),
                                _attributes(link.get("attributes")),
                            )
                            for link in span.get("links", [])
                        ),
                    )
                )
    return found


class Picture:
    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans

    def named(self, name: str, **attributes: object) -> list[Span]:
        wanted = {key.replace("__", "."): value for key, value in attributes.items()}
        return [
            s
            for s in self.spans
            if s.name == name and all(s.attributes.get(k) == v for k, v in wanted.items())
        ]

    def one(self, name: str, **attributes: object) -> Span:
        found = self.named(name, **attributes)
        assert len(found) == 1, f"{name} {attributes}: {len(found)} spans"
        return found[0]

    def by_id(self, span_id: str) -> Span:
        (span,) = [s for s in self.spans if s.span_id == span_id]
        return span

    def children(self, span: Span) -> list[Span]:
        return [s for s in self.spans if s.parent_id == span.span_id]

    def assert_connected(self, root: Span) -> None:
        trace = [s for s in self.spans if s.trace_id == root.trace_id]
        ids = {s.span_id for s in trace}
        assert [s for s in trace if not s.parent_id] == [root]
        assert all(s.parent_id in ids for s in trace if s is not root)


# --- the dashboard's queries ------------------------------------------------------------------


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every Prometheus query on the dashboard."""
    found = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource") or {}
            if source.get("type") == "prometheus":
                found.append((panel["title"], target["refId"], target["expr"]))
    return found


def substitute(expr: str, *, job: str, rate_interval: str) -> str:
    """The query Grafana sends for these variable values (instance: All)."""
    # Regex metacharacters escaped inside a PromQL string (Grafana does the same for =~).
    escaped = re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\\\1", job)
    variables = {"job": escaped, "instance": ".*", "__rate_interval": rate_interval}
    unknown = set(re.findall(r"\$\{?(\w+)", expr)) - set(variables)
    assert not unknown, f"{expr}: variables the test does not set: {unknown}"
    for name, value in variables.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


def totals(expr: str) -> str:
    """The same query over the counters themselves instead of their rates: the totals the
    rates were taken of, compared with the ground truth exactly."""
    return re.sub(r"rate\(([^\[]+)\[[^\]]+\]\)", r"\1", expr)


def vector(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(point["metric"].get(label, "") for label in labels): float(point["value"][1])
        for point in result
    }


def bucket_bound(seconds: float) -> float:
    """The upper bound of the lateness bucket holding `seconds`."""
    return next((b for b in LATENESS_BUCKETS if seconds <= b), math.inf)


# --- the test ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_lapse_through_a_collector_into_jaeger_and_prometheus(
    protocol: str,
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    kfp_database: Database,
    backends: Backends,
    seaweedfs: EmbeddedSeaweedFS,
) -> None:
    prometheus, jaeger, collector = backends.prometheus, backends.jaeger, backends.collector
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube, kfp_database)
    # The KFP runs' artifacts too, on the database clock (the policy's 6 s): a declared
    # prefix per run in the S3 server.
    prefix = f"otel-{uuid.uuid4().hex[:6]}"
    with config.open("a") as out:
        out.write(
            "artifacts:\n  stores:\n"
            f"    - {{name: otel, url: 's3://{ARTIFACT_BUCKET}/{prefix}/', "
            f"endpoint: '{seaweedfs.endpoint}', region: {REGION}, "
            "capture: {argo-workflow: ['{namespace}/{name}/']}}\n"
        )
    env = {
        **os.environ,
        **seaweedfs.env(),
        # OTLP over HTTP/protobuf (the default) or gRPC: the Collector's two receivers.
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://"
        + loopback(collector.otlp_grpc if protocol == "grpc" else collector.otlp_http),
        "OTEL_SERVICE_NAME": "lapse",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "LAPSE_PROMETHEUS_PORT": str(backends.lapse_metrics_port),
        "LAPSE_PROMETHEUS_HOST": "127.0.0.1",
    }
    log = tmp_path / "up.log"
    up = TelemetryLapseUp(config, tmp_path / "state", log, env)
    started = time.time()
    await up.start()
    engine = create_engine(kfp_database.url)
    wfs = kube.workflows
    ns = kube.namespace(f"otel-{uuid.uuid4().hex[:6]}")
    kfp_uids: dict[str, str] = {}

    s3 = client(seaweedfs)
    artifact_bytes = 0

    async def create_wave(plain: list[tuple[str, int]], kfp_name: str, run_id: str) -> None:
        nonlocal artifact_bytes
        keys = [f"{prefix}/{ns}/{kfp_name}/{i}.log" for i in range(ARTIFACTS_PER_RUN)]
        await plant(s3, *keys)
        artifact_bytes += sum(len(f"content of {key}") for key in keys)
        for name, ttl in plain:
            await wfs.create(ns, finished_workflow(name, annotations={"lapse.dev/ttl": f"{ttl}s"}))
        labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
        created = await wfs.create(ns, finished_workflow(kfp_name, labels=labels))
        kfp_uids[kfp_name] = created["metadata"]["uid"]

    async def objects_gone() -> bool:
        return not (await wfs.list(ns))["items"]

    def artifacts_gone(kfp_name: str) -> Any:
        async def gone() -> bool:
            return not await present(s3, f"{prefix}/{ns}/{kfp_name}/")

        return gone

    def rows_gone(run_id: str) -> Any:
        async def gone() -> bool:
            async with engine.connect() as conn:
                return sum((await kfp_counts(conn, run_id)).values()) == 0

        return gone

    def prometheus_sees(expr: str, wanted: float) -> Any:
        async def seen() -> bool:
            for job in JOBS:
                result = prometheus.query(expr.replace("JOB", job))
                if not result or float(result[0]["value"][1]) < wanted:
                    return False
            return True

        return seen

    async def refuse_a_push() -> None:
        """A push the ingress refuses (not a CloudEvent): answered 400, counted, and recorded
        on the dead letters for an operator to see."""
        async with httpx.AsyncClient(timeout=30) as http:
            refused = await http.post(
                f"http://127.0.0.1:{up.ingress_port}/",
                content=b"not a CloudEvent",
                headers={"content-type": "application/json"},
            )
        assert refused.status_code == 400, refused.text

    def retries_logged() -> int:
        return len(re.findall(r"row-reaper: try \d+ failed", log.read_text()))

    try:
        # Wave 1: every series appears (a counter's first value is not a rate yet).
        run_1, run_2 = str(uuid.uuid4()), str(uuid.uuid4())
        async with engine.begin() as conn:
            await insert_kfp_runs(conn, [run_1, run_2], namespace=ns)
        await create_wave([("plain-1", 2)], "kfp-1", run_1)
        await refuse_a_push()
        await wait_for(objects_gone, timeout=60, interval=0.5)
        await wait_for(rows_gone(run_1), timeout=60, interval=0.5)
        await wait_for(artifacts_gone("kfp-1"), timeout=60, interval=0.5)
        deletions = 'sum(lapse_deletions_total{job="JOB"})'
        await wait_for(prometheus_sees(deletions, 4), timeout=60, interval=0.5)

        # Wave 2, with the second run's main row locked: its deletion fails on the lock
        # and is retried until the lock goes.
        async with engine.connect() as locker:
            lock = await locker.begin()
            locked = await locker.execute(
                select(run_details.c.UUID).where(run_details.c.UUID.in_([run_2])).with_for_update()
            )
            assert locked.all() == [(run_2,)]
            await create_wave([("plain-2", 2), ("plain-3", 3)], "kfp-2", run_2)
            await wait_for(objects_gone, timeout=60, interval=0.5)

            async def two_retries() -> bool:
                return retries_logged() >= 2

            await wait_for(two_retries, timeout=60, interval=0.2)
            retried = 'sum(lapse_retries_total{job="JOB"})'
            await wait_for(prometheus_sees(retried, 2), timeout=30, interval=0.5)
            await lock.rollback()
        await wait_for(rows_gone(run_2), timeout=60, interval=0.5)
        await wait_for(artifacts_gone("kfp-2"), timeout=60, interval=0.5)
        await wait_for(prometheus_sees(deletions, 9), timeout=60, interval=0.5)

        # A second refused push (the first came with wave 1): a counter's rate needs two.
        await refuse_a_push()
        dead = 'max(lapse_dlq_depth{job="JOB"})'
        await wait_for(prometheus_sees(dead, 2), timeout=60, interval=0.5)

        async def drained() -> bool:
            for job in JOBS:
                pending = prometheus.query(f'lapse_schedule_pending{{job="{job}"}}')
                if len(pending) != 3 or any(float(p["value"][1]) for p in pending):
                    return False
            return True

        await wait_for(drained, timeout=60, interval=0.5)
        history = lapse_json("history", "-n", ns, "--all", config=config)
        status = lapse_json("status", config=config)
        retries = retries_logged()
        finished = time.time()
    finally:
        await engine.dispose()
        assert up.stop() == 0, log.read_text()[-3000:]

    # --- ground truth -------------------------------------------------------------------
    outcomes = Counter((r["target"], r["outcome"]) for r in history if r["outcome"])
    assert outcomes == {
        ("kubernetes", "deleted"): 5,
        ("database", "deleted"): 2,
        ("artifacts", "deleted"): 2,
    }
    lateness = {
        target: [r["latencySeconds"] for r in history if r["outcome"] and r["target"] == target]
        for target in ("kubernetes", "database", "artifacts")
    }
    scheduled = Counter(r["target"] for r in history if r["event"] == "cleanup.scheduled")
    assert status["deadLetters"] == 2  # the ingress's records of the refused pushes
    assert retries == 2, "the lock was let go after the second retry"

    # --- traces (Jaeger) ------------------------------------------------------------------
    async def traces_arrived() -> bool:
        found = spans_of(jaeger.traces("lapse", started - 60, finished + 60))
        reapers = Picture(found).named("row-reaper", lapse__outcome="deleted")
        return len(reapers) == 2

    await wait_for(traces_arrived, timeout=30, interval=0.5)
    picture = Picture(spans_of(jaeger.traces("lapse", started - 60, finished + 60)))
    assert {s.service for s in picture.spans} == {"lapse"}
    uid = kfp_uids["kfp-1"]
    planner = picture.one(
        "ttl-planner", lapse__run__uid=uid, cloudevents__event_type="dev.lapse.run.finished.v1"
    )
    consumed = picture.by_id(planner.parent_id)
    assert (consumed.kind, consumed.name) == (
        "CONSUMER",
        "process lapse.events.dev.lapse.run.finished.v1",
    )
    decisions = {}
    for target in ("kubernetes", "database"):
        decision = picture.one(f"schedule {target}", lapse__run__uid=uid)
        assert decision.parent_id == planner.span_id
        assert decision.attributes["lapse.schedule.action"] == "created"
        (put,) = [s for s in picture.children(decision) if s.kind == "PRODUCER"]
        assert put.name == f"send lapse.sched.{target}.*"
        assert put.attributes["messaging.destination.name"] == f"lapse.sched.{target}.{uid}"
        decisions[target] = (decision, put)
    for target, function in (("kubernetes", "object-reaper"), ("database", "row-reaper")):
        decision, put = decisions[target]
        (due,) = [
            s
            for s in picture.named(f"process lapse.due.{target}.*")
            if s.attributes.get("messaging.destination.name") == f"lapse.due.{target}.{uid}"
        ]
        assert due.kind == "CONSUMER" and not due.parent_id
        assert due.trace_id != decision.trace_id
        assert {(link.span_id, link.attributes.get("lapse.link")) for link in due.links} == {
            (decision.span_id, "creation"),
            (put.span_id, "hop"),
        }
        reaper = picture.one(function, lapse__run__uid=uid)
        assert reaper.parent_id == due.span_id
        assert reaper.attributes["lapse.outcome"] == "deleted"
        assert reaper.attributes["lapse.target"] == target
        picture.assert_connected(due)
    kube_calls = [
        (s.name.split(" ")[0], s.attributes.get("http.response.status_code"))
        for s in picture.children(picture.one("object-reaper", lapse__run__uid=uid))
        if s.kind == "CLIENT"
    ]
    # The version lapse's watcher read is DELETEd held to its resourceVersion: no GET first
    # (safety.read_before_delete: auto).
    assert kube_calls == [("DELETE", 200)]
    # The second run's successful delete, and every DELETE statement lapse ran.
    second = picture.one("row-reaper", lapse__run__uid=kfp_uids["kfp-2"], lapse__outcome="deleted")
    statements_per_run = len([s for s in picture.children(second) if s.kind == "CLIENT"])
    database_deletes = [
        s
        for s in picture.spans
        if s.kind == "CLIENT" and "db.system.name" in s.attributes and s.name.startswith("DELETE")
    ]
    delete_statements = len(database_deletes)
    assert len({s.span_id for s in picture.spans}) == len(picture.spans), "no span twice"

    # --- every dashboard panel query (Prometheus) ------------------------------------------
    window = f"{math.ceil(finished - started) + 30}s"
    # The safety net's panel is the Knative shape's policy watcher's (lapse up runs no
    # periodic pass): its queries are checked by the dashboard's own tests, not here.
    everything = panel_queries()
    queries = [q for q in everything if "lapse_reconcile_" not in q[2]]
    assert len(everything) - len(queries) == 3
    assert len(queries) == 17
    returned: dict[tuple[str, str, str], dict[tuple[str, ...], float]] = {}
    for job in JOBS:
        for title, ref, expr in queries:
            query = substitute(expr, job=job, rate_interval=window)
            result = prometheus.query(query, at=finished)
            assert result, f"{job}: {title} {ref} returned nothing: {query}"
            by = re.search(r"\bby \(([^)]*)\)", expr)
            labels = tuple(
                label.strip() for label in (by.group(1) if by else "").split(",") if label.strip()
            )
            labels = tuple(label for label in labels if label != "le")
            values = vector(result, *labels)
            returned[(job, title, ref)] = values
            assert all(math.isfinite(v) and v >= 0 for v in values.values()), (title, values)
            total = vector(prometheus.query(totals(query), at=finished), *labels)
            check_panel(
                title, ref, values, total,
                truth={
                    "outcomes": outcomes, "lateness": lateness, "scheduled": scheduled,
                    "status": status, "retries": retries,
                    "statements_per_run": statements_per_run,
                    "delete_statements": delete_statements,
                    "artifacts": (2 * ARTIFACTS_PER_RUN, artifact_bytes),
                },
            )  # fmt: skip
        # The lateness histogram itself: one observation per deletion, summing to the
        # lateness the audit trail reports.
        scope = f'{{job="{job}"}}'
        count = vector(
            prometheus.query(
                f"sum by (lapse_target) (lapse_deletion_lateness_seconds_count{scope})", at=finished
            ),
            "lapse_target",
        )
        assert count == {(t,): float(len(seconds)) for t, seconds in lateness.items()}
        seconds = vector(
            prometheus.query(
                f"sum by (lapse_target) (lapse_deletion_lateness_seconds_sum{scope})", at=finished
            ),
            "lapse_target",
        )
        for target, observed in lateness.items():
            assert seconds[(target,)] == pytest.approx(sum(observed), abs=0.01 * len(observed))
    for (job, title, ref), values in returned.items():
        print(f"{job:12} {title} [{ref}]: {values}")

    # --- exemplars: a lateness bucket links to the deletion's trace ------------------------
    # Through the Collector only: it serves OpenMetrics with the SDK's exemplars (recorded
    # inside the reaper's span); lapse's own /metrics carries none.
    params = urllib.parse.urlencode(
        {
            "query": f'lapse_deletion_lateness_seconds_bucket{{job="{VIA_COLLECTOR}"}}',
            "start": f"{started - 60:.3f}",
            "end": f"{finished + 60:.3f}",
        }
    )
    exemplars = [
        (exemplar["labels"], float(exemplar["value"]))
        for series in prometheus.get(f"/api/v1/query_exemplars?{params}")["data"]
        for exemplar in series["exemplars"]
    ]
    assert exemplars, "no exemplar on the lateness histogram"
    reapers = {
        s.span_id: s
        for s in picture.spans
        if s.name in {"object-reaper", "row-reaper", "artifact-reaper"}
    }
    for labels, value in exemplars:
        reaper = reapers[labels["span_id"]]
        assert reaper.trace_id == labels["trace_id"]
        assert reaper.attributes["lapse.outcome"] == "deleted"
        assert value == pytest.approx(reaper.attributes["lapse.lateness_seconds"])

    # --- the alert rules ran on this Prometheus, and none fires on a healthy run -----------
    rules = prometheus.get("/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule for group in rules for rule in group["rules"]}
    assert len(loaded) == 5
    assert all(rule["health"] == "ok" for rule in loaded.values()), loaded
    alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    # The refused push is a new dead letter: the one alert that fires. The row-reaper's
    # wait ended within seconds, far short of the outage rule's 5 minutes.
    firing = {
        (a["labels"]["alertname"], a["labels"]["job"]) for a in alerts if a["state"] == "firing"
    }
    assert firing == {("LapseDeadLettersGrowing", job) for job in JOBS}, alerts
    assert not [a for a in alerts if a["labels"]["alertname"] != "LapseDeadLettersGrowing"]


def check_panel(
    title: str,
    ref: str,
    values: dict[tuple[str, ...], float],
    total: dict[tuple[str, ...], float],
    truth: dict[str, Any],
) -> None:
    """One panel query's result (`values`, keyed by its `by` labels) against the ground
    truth; `total` is the same query over the counters instead of their rates."""
    outcomes: Counter[tuple[str, str]] = truth["outcomes"]
    if title == "Deletions per second by outcome":
        assert set(values) == set(outcomes) and all(v > 0 for v in values.values())
        assert total == {key: float(count) for key, count in outcomes.items()}
    elif title == "Deletion lateness p50 / p99":
        for (target,), seconds in values.items():
            observed = truth["lateness"][target]
            assert 0 <= seconds <= bucket_bound(max(observed)), (target, seconds, observed)
        assert {key for key in values} == {("kubernetes",), ("database",), ("artifacts",)}
    elif title == "Pending schedules":
        pending = {(t,): float(p["count"]) for t, p in truth["status"]["pending"].items()}
        assert values == pending
        assert pending == {("kubernetes",): 0.0, ("database",): 0.0, ("artifacts",): 0.0}
    elif title == "Dead-letter depth":
        # The ingress's records of the refused pushes; no deletion was given up on.
        assert values == {(): float(truth["status"]["deadLetters"])} == {(): 2.0}
    elif title == "Retries per second":
        assert set(values) == {("row-reaper", "RetryLater")} and all(v > 0 for v in values.values())
        assert total == {("row-reaper", "RetryLater"): float(truth["retries"])}
    elif title == "API calls per deletion":
        # Ratios of rates: every deletion of the second wave, exactly.
        assert values[("kubernetes",)] == pytest.approx(1.0)  # the DELETE alone (auto)
        assert values[("database",)] == pytest.approx(truth["statements_per_run"])
    elif title == "Schedules created / replaced / cancelled per second":
        assert set(values) == {("created",)} and values[("created",)] > 0
        assert total == {("created",): float(sum(truth["scheduled"].values()))}
    elif title == "Handler duration p99":
        assert set(values) == {
            ("ttl-planner",),
            ("object-reaper",),
            ("row-reaper",),
            ("artifact-reaper",),
        }
        assert all(0 < v <= 30 for v in values.values())
    elif title == "Kubernetes requests per second":
        assert values[("DELETE", "200")] > 0
        kubernetes_deleted = outcomes[("kubernetes", "deleted")]
        assert total[("DELETE", "200")] == float(kubernetes_deleted)
    elif title == "Database statements per second":
        assert values[("DELETE",)] > 0
        assert total[("DELETE",)] == float(truth["delete_statements"])
    elif title == "Artifacts deleted per second":
        objects, size = truth["artifacts"]
        assert set(values) == {("otel",)} and all(v > 0 for v in values.values())
        assert total == {("otel",): float(objects if ref == "A" else size)}
    elif title == "Waiting out an outage":
        # The row-reaper waited out the lock (its retries), and waits no more.
        assert values == {("row-reaper",): 0.0}, (ref, values)
    elif title == "Ingress refusals per second":
        assert set(values) == {("400", "not_cloudevent", "true")} and all(
            v > 0 for v in values.values()
        )
        assert total == {("400", "not_cloudevent", "true"): 2.0}
    elif title == "Watch leases: which process watches which kind":
        # lapse up on a NATS it did not start holds the lease of every kind it watches
        # (kubernetes.watch_lease), one process each: the Workflows' kind among them.
        kinds = [kind for kind, _ in values]
        assert "argo-workflow" in kinds and len(kinds) == len(set(kinds)), values
        assert all(v == 1.0 for v in values.values()), values
    else:
        raise AssertionError(f"panel {title!r} [{ref}] has no ground truth in this test")


def test_the_panel_query_helpers() -> None:
    expr = 'sum by (a) (rate(x_total{job=~"$job", instance=~"$instance"}[$__rate_interval]))'
    query = substitute(expr, job="lapse-scrape", rate_interval="90s")
    assert query == 'sum by (a) (rate(x_total{job=~"lapse-scrape", instance=~".*"}[90s]))'
    assert totals(query) == 'sum by (a) (x_total{job=~"lapse-scrape", instance=~".*"})'
    assert substitute('{job=~"$job"}', job="a.b", rate_interval="1s") == '{job=~"a\\\\.b"}'
    assert bucket_bound(0.3) == 0.5 and bucket_bound(1.0) == 1.0
    assert (
        _id("AAECAwQFBgc=") == "0001020304050607" and _id("ABCDEF0123456789") == "abcdef0123456789"
    )
