"""infra/otel/: every metric the Grafana dashboard queries is one lapse emits, under the
name Prometheus gives it, and the Collector configuration is well formed.

The OpenTelemetry -> Prometheus names are not derived by hand: each documented metric is
recorded once and read back through the real Prometheus exporter (the same conversion the
scrape endpoint and the Collector apply), so a renamed metric or a changed unit fails here.
No Collector binary is available to `otelcol validate` the configuration, so it is checked
against the structure the Collector documents.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lapse import infra
from lapse.telemetry import METRICS, names

# --- what lapse emits, as Prometheus sees it ------------------------------------------------


def prometheus_series() -> dict[str, set[str]]:
    """Every Prometheus sample name lapse's metrics produce, with the labels it carries."""
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    meter = provider.get_meter("lapse")
    for spec in METRICS:
        attributes = {key: "x" for key in spec.attributes}
        if spec.kind == "counter":
            meter.create_counter(spec.name, spec.unit, spec.description).add(1, attributes)
        elif spec.kind == "histogram":
            meter.create_histogram(spec.name, spec.unit, spec.description).record(1, attributes)
        else:

            def observe(_: CallbackOptions, a: dict[str, str] = attributes) -> list[Observation]:
                return [Observation(1, a)]

            meter.create_observable_gauge(spec.name, [observe], spec.unit, spec.description)
    text = generate_latest(registry).decode()
    provider.shutdown()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def emitted() -> dict[str, set[str]]:
    return prometheus_series()


def test_the_documented_names_map_as_the_dashboard_expects(emitted: dict[str, set[str]]) -> None:
    assert "lapse_deletions_total" in emitted
    assert {"lapse_target", "lapse_outcome"} <= emitted["lapse_deletions_total"]
    assert "lapse_deletion_lateness_seconds_bucket" in emitted
    assert "le" in emitted["lapse_deletion_lateness_seconds_bucket"]
    assert "lapse_schedule_pending" in emitted
    assert "lapse_dlq_depth" in emitted


# --- the dashboard --------------------------------------------------------------------------

DASHBOARD = json.loads(infra.read_text("otel/grafana-dashboard.json"))
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                   "offset", "and", "or", "unless", "inf", "nan"}  # fmt: skip
# Labels Prometheus adds to every scraped series (the Collector's exporter sets them from
# service.name and service.instance.id).
TARGET_LABELS = {"job", "instance"}
REQUIRED_PANELS = {
    "Deletions per second by outcome",
    "Deletion lateness p50 / p99",
    "Pending schedules",
    "Dead-letter depth",
    "Retries per second",
    "API calls per deletion",
    "Artifacts deleted per second",
}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))  # collapsed rows hold their panels


def targets(kind: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for panel in panels(DASHBOARD["panels"]):
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource") or {}
            if source.get("type") == kind:
                found.append((panel["title"], target))
    return found


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, labels it is filtered or grouped on) for every series an expression reads.

    Small on purpose: enough PromQL for dashboards (functions, aggregations with by/without,
    selectors with matchers, ranges, binary operators), not a full parser."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    grouping = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        grouping.update(label.strip() for label in clause.split(",") if label.strip())
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery durations
    found = []
    pattern = r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?"
    for name, matchers, call in re.findall(pattern, expr):
        if call or name in PROMQL_KEYWORDS:
            continue
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=|!=|=~|!~)", matchers))
        found.append((name, labels | grouping))
    return found


def test_the_selector_reader_finds_metrics_and_labels() -> None:
    expr = (
        'sum by (lapse_api) (rate(a_sum{lapse_outcome="deleted"}[5m])) '
        "/ histogram_quantile(0.5, sum by (le) (rate(b_bucket[$__rate_interval])))"
    )
    assert selectors(expr) == [
        ("a_sum", {"lapse_outcome", "lapse_api", "le"}),
        ("b_bucket", {"lapse_api", "le"}),
    ]


def test_the_dashboard_has_the_panels_operators_need() -> None:
    titles = {panel["title"] for panel in panels(DASHBOARD["panels"])}
    assert titles >= REQUIRED_PANELS
    ids = [panel["id"] for panel in panels(DASHBOARD["panels"])]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert set(variables) == {"prometheus", "tempo", "job", "instance"}
    assert (variables["prometheus"]["type"], variables["prometheus"]["query"]) == (
        "datasource",
        "prometheus",
    )
    assert (variables["tempo"]["type"], variables["tempo"]["query"]) == ("datasource", "tempo")
    # job and instance list what Prometheus holds of lapse's metrics; every query filters
    # on both, so two lapse installations (or two paths, scrape and Collector) never add up.
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${prometheus}"
        assert variables[name]["definition"].startswith('label_values({__name__=~"lapse_.+"')
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    for title, target in targets("prometheus"):
        for metric, labels in selectors(target["expr"]):
            assert {"job", "instance"} <= labels, f"{title}: {metric} is not filtered by job"


def test_every_metric_the_dashboard_queries_is_one_lapse_emits(
    emitted: dict[str, set[str]],
) -> None:
    queries = targets("prometheus")
    assert len(queries) >= len(REQUIRED_PANELS)
    read = set()
    for title, target in queries:
        for metric, labels in selectors(target["expr"]):
            assert metric in emitted, f"{title}: lapse emits no {metric}"
            unknown = labels - emitted[metric] - TARGET_LABELS
            assert not unknown, f"{title}: {metric} has no label {sorted(unknown)}"
            read.add(metric)
    # Every documented metric is on the dashboard in some form.
    for spec in METRICS:
        stem = re.sub(r"[^a-zA-Z0-9]+", "_", spec.name)
        assert any(name.startswith(stem) for name in read), f"{spec.name} is on no panel"


def test_an_outcome_links_to_its_traces() -> None:
    tempo = targets("tempo")
    assert tempo, "a panel lists the reapers' spans from Tempo"
    documented = {value for key, value in vars(names).items() if key.isupper()}
    for title, target in tempo:
        for attribute in re.findall(r"span\.([a-z_.]+)", target["query"]):
            assert attribute in documented, f"{title}: lapse sets no span attribute {attribute}"
    (outcomes,) = [
        p for p in panels(DASHBOARD["panels"]) if p["title"] == "Deletions per second by outcome"
    ]
    (link,) = outcomes["fieldConfig"]["defaults"]["links"]
    assert "${tempo}" in link["url"]
    assert "span.lapse.outcome" in link["url"]
    assert "${__field.labels.lapse_outcome}" in link["url"]
    (lateness,) = [
        p for p in panels(DASHBOARD["panels"]) if p["title"] == "Deletion lateness p50 / p99"
    ]
    assert all(target.get("exemplar") for target in lateness["targets"])


def test_artifacts_deleted_and_bytes_freed_are_on_the_dashboard() -> None:
    (panel,) = [
        p for p in panels(DASHBOARD["panels"]) if p["title"] == "Artifacts deleted per second"
    ]
    read = {target["refId"]: selectors(target["expr"]) for target in panel["targets"]}
    assert [name for name, _ in read["A"]] == ["lapse_artifacts_deleted_total"]
    assert [name for name, _ in read["B"]] == ["lapse_artifacts_freed_bytes_total"]
    (bytes_axis,) = panel["fieldConfig"]["overrides"]
    assert bytes_axis["matcher"]["options"] == "B"
    assert {"id": "unit", "value": "Bps"} in bytes_axis["properties"]


# --- the PodMonitors ------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against pod labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if not held[operator]:
            return False
    return True


def knative_pods() -> dict[str, dict[str, str]]:
    """Each lapse function's pod labels as Knative sets them: the revision template's
    labels, and serving.knative.dev/service naming the Service. The artifact-reaper is
    opt-in (infra/components/artifacts) and still scraped once deployed."""
    files = ("knative/functions.yaml", "components/artifacts/service.yaml")
    pods = {}
    for file in files:
        for doc in yaml.safe_load_all(infra.read_text(file)):
            if doc and doc["apiVersion"].startswith("serving.knative.dev/"):
                name = doc["metadata"]["name"]
                template = doc["spec"]["template"].get("metadata") or {}
                pods[name] = {**template.get("labels", {}), "serving.knative.dev/service": name}
    return pods


def test_the_pod_monitors_scrape_every_function_the_artifact_reaper_too() -> None:
    monitors = [
        doc
        for doc in yaml.safe_load_all(infra.read_text("components/monitoring/podmonitors.yaml"))
        if doc and doc["kind"] == "PodMonitor"
    ]
    pods = knative_pods()
    assert {"lapse-ttl-planner", "lapse-object-reaper", "lapse-row-reaper",
            "lapse-artifact-reaper"} <= set(pods)  # fmt: skip
    for name, labels in pods.items():
        scraping = [m for m in monitors if selects(m["spec"]["selector"], labels)]
        ports = {e["port"] for m in scraping for e in m["spec"]["podMetricsEndpoints"]}
        # Knative's one declared port, re-addressed to the metrics port beside it.
        assert "user-port" in ports, f"no PodMonitor scrapes {name}"
        # job="lapse", as every alert rule and panel aggregates by.
        assert all(m["spec"]["jobLabel"] == "app.kubernetes.io/part-of" for m in scraping)


# --- the Collector configuration ------------------------------------------------------------

COLLECTOR = yaml.safe_load(infra.read_text("otel/collector.yaml"))
SECTIONS = ("receivers", "processors", "exporters", "extensions", "connectors")
# Component types of the contrib distribution this configuration relies on (0.144+ names).
KNOWN = {
    "receivers": {"otlp"},
    "processors": {"batch", "memory_limiter"},
    "exporters": {"otlp_grpc", "otlp_http", "prometheus", "debug"},
    "extensions": {"health_check"},
    "connectors": set(),
}
COMPONENT_ID = re.compile(r"^([a-z][a-z0-9_]*)(?:/[^/\s]+)?$")
PIPELINE_ID = re.compile(r"^(traces|metrics|logs)(?:/[^/\s]+)?$")


def component_type(component_id: str) -> str:
    match = COMPONENT_ID.match(component_id)
    assert match, f"{component_id!r} is not type[/name]"
    return match.group(1)


def test_the_collector_configuration_has_the_documented_structure() -> None:
    assert set(COLLECTOR) <= {*SECTIONS, "service"}
    for section in SECTIONS:
        for component_id, settings in (COLLECTOR.get(section) or {}).items():
            assert component_type(component_id) in KNOWN[section], f"{section}: {component_id}"
            assert settings is None or isinstance(settings, dict)
    service = COLLECTOR["service"]
    assert set(service) <= {"extensions", "pipelines", "telemetry"}
    for extension in service.get("extensions", []):
        assert extension in COLLECTOR["extensions"], f"service.extensions: {extension}"
    pipelines = service["pipelines"]
    assert {component_type(p) for p in pipelines} >= {"traces", "metrics"}
    used: dict[str, set[str]] = {section: set() for section in SECTIONS}
    for pipeline_id, pipeline in pipelines.items():
        assert PIPELINE_ID.match(pipeline_id), pipeline_id
        assert set(pipeline) <= {"receivers", "processors", "exporters"}
        assert pipeline.get("receivers"), f"{pipeline_id} needs a receiver"
        assert pipeline.get("exporters"), f"{pipeline_id} needs an exporter"
        for section in ("receivers", "processors", "exporters"):
            listed = pipeline.get(section, [])
            assert len(listed) == len(set(listed)), f"{pipeline_id}: {section} repeated"
            for component_id in listed:
                assert component_id in (COLLECTOR.get(section) or {}), (
                    f"{pipeline_id} uses {component_id}, which {section} does not define"
                )
            used[section].update(listed)
        processors = pipeline.get("processors", [])
        if "memory_limiter" in processors:
            assert processors[0] == "memory_limiter", "memory_limiter goes first"
    for section in ("receivers", "processors", "exporters"):
        unused = set(COLLECTOR.get(section) or {}) - used[section]
        assert not unused, f"{section} defined but in no pipeline: {unused}"


def test_the_collector_takes_otlp_http_and_serves_what_the_dashboard_reads() -> None:
    http = COLLECTOR["receivers"]["otlp"]["protocols"]["http"]
    assert http["endpoint"].endswith(":4318")  # lapse exports OTLP over HTTP/protobuf
    pipelines = COLLECTOR["service"]["pipelines"]
    assert "otlp" in pipelines["traces"]["receivers"]
    assert "otlp" in pipelines["metrics"]["receivers"]
    assert any(
        component_type(e) in {"otlp_grpc", "otlp_http"} for e in pipelines["traces"]["exporters"]
    )
    assert "prometheus" in pipelines["metrics"]["exporters"]
    prometheus = COLLECTOR["exporters"]["prometheus"]
    # A namespace or dropped suffixes would rename every metric the dashboard queries.
    assert "namespace" not in prometheus
    assert prometheus.get("add_metric_suffixes", True) is True
    assert prometheus["enable_open_metrics"] is True  # exemplars: lateness -> trace
    for section in ("receivers", "exporters", "extensions"):
        for settings in (COLLECTOR.get(section) or {}).values():
            for endpoint in re.findall(r"'endpoint': '([^']*)'", str(settings)):
                assert re.fullmatch(r"[\w.-]+:\d{2,5}", endpoint), endpoint
