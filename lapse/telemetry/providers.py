"""Which tracer and meter lapse uses, and setting them up from the standard environment.

OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG),
OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT/HEADERS/TIMEOUT/..., OTEL_BSP_*,
OTEL_METRIC_EXPORT_INTERVAL and OTEL_SDK_DISABLED mean what the SDK says;
OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL is http/protobuf (the default) or grpc.
OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER take otlp, console or none (metrics also
prometheus, on OTEL_EXPORTER_PROMETHEUS_HOST/PORT). Unlike the SDK's own default, OTLP is
used only when an endpoint or the exporter is named: with nothing configured no SDK is
installed, nothing leaves the process, and lapse starts no spans and records no metrics
(a flag check per hop is all it costs).
LAPSE_PROMETHEUS_PORT serves the metrics for scraping, for clusters without a collector,
on LAPSE_PROMETHEUS_HOST; unset, on the address the process's own HTTP endpoint listens on
(`lapse up --listen`, `lapse bridge --listen`: loopback unless it is opened), else 0.0.0.0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from lapse.errors import LapseError
from lapse.functions.tracing import use_tracer
from lapse.telemetry.instruments import Instruments
from lapse.telemetry.names import SCOPE

log = logging.getLogger(__name__)


class TelemetryError(LapseError, ValueError):
    """The OTEL_* / LAPSE_PROMETHEUS_* settings cannot be used."""


@dataclass(frozen=True)
class _State:
    tracer: Tracer
    instruments: Instruments
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None


def _api_state() -> _State:
    # The API's no-op tracer and meter: nothing is recorded until `install` or `configure`.
    return _State(trace.NoOpTracer(), Instruments(metrics.NoOpMeter(SCOPE)))


_state = _api_state()
_lock = threading.Lock()
# Providers `configure` made global: the API allows that once per process, so after their
# shutdown they stay global and must not be mistaken for someone else's SDK.
_ours: list[object] = []


def current() -> _State:
    return _state


def _set(state: _State) -> None:
    """Switch lapse's tracer and meter (hold `_lock`); the handlers' steps follow."""
    global _state
    _state = state
    use_tracer(state.tracer if state.tracer_provider is not None else None)


def tracer() -> Tracer:
    return _state.tracer


def instruments() -> Instruments:
    return _state.instruments


@dataclass
class Telemetry:
    """What `configure`/`install` return: flush it before exit, or shut it down if owned."""

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    owned: bool = False
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.tracer_provider is not None or self.meter_provider is not None

    def flush(self, timeout_millis: int = 10_000) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_millis)
        if self.meter_provider is not None:
            self.meter_provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is buffered and stop (owned providers); otherwise only flush.

        Called when a process stops (Pipeline end, FunctionShell.stop), so a function
        scaled to zero loses no spans."""
        global _state
        if not self.owned:
            self.flush()
            return
        self.owned = False
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        for close in self.closers:
            with contextlib.suppress(Exception):
                close()
        with _lock:
            if (_state.tracer_provider, _state.meter_provider) == (
                self.tracer_provider,
                self.meter_provider,
            ):
                _set(_api_state())


def install(
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    owned: bool = False,
    closers: Sequence[Callable[[], None]] = (),
) -> Telemetry:
    """Make lapse use these providers (tests, `lapse demo`); None records nothing."""
    global _state
    with _lock:
        _set(
            _State(
                tracer_provider.get_tracer(SCOPE) if tracer_provider else trace.NoOpTracer(),
                Instruments(
                    meter_provider.get_meter(SCOPE) if meter_provider else metrics.NoOpMeter(SCOPE)
                ),
                tracer_provider,
                meter_provider,
            )
        )
    return Telemetry(tracer_provider, meter_provider, owned, list(closers))


def reset() -> None:
    """Back to recording nothing (after a test that installed its own providers)."""
    with _lock:
        _set(_api_state())


@dataclass
class InMemoryTelemetry:
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    handle: Telemetry

    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()


def install_in_memory(service_name: str = "lapse") -> InMemoryTelemetry:
    """Record spans and metrics in this process only (tests; the demo's trace tree)."""
    resource = Resource.create({SERVICE_NAME: service_name})
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    handle = install(tracer_provider=tracer_provider, meter_provider=meter_provider, owned=True)
    return InMemoryTelemetry(exporter, reader, handle)


def tracing_enabled() -> bool:
    """Whether lapse records spans: it has an SDK tracer (from `install`, or `configure`,
    which adopts one the process already set globally). When not, lapse starts no spans at
    all, so it neither records nor forwards trace context: the cost is this check."""
    return _state.tracer_provider is not None


def metrics_enabled() -> bool:
    """Whether lapse records metrics (pollers stay idle otherwise); see `tracing_enabled`."""
    return _state.meter_provider is not None


def configure(
    service_name: str = "lapse",
    env: Mapping[str, str] | None = None,
    *,
    metrics_host: str | None = None,
    http_host: str | None = None,
) -> Telemetry:
    """Set up exporting from the standard environment, once per process.

    Returns the handle to flush or shut down at exit. With no exporter configured nothing
    is installed (no threads, no sockets). If this process already has an SDK (installed
    by `install`, a test, or OpenTelemetry auto-instrumentation), that one is used as is.
    `service_name` applies when OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name none.
    LAPSE_PROMETHEUS_PORT listens on `metrics_host` (a flag), else LAPSE_PROMETHEUS_HOST,
    else `http_host` (the process's own HTTP address: metrics reachable no further than
    it), else every address.
    """
    env = os.environ if env is None else env
    if _state.tracer_provider is not None or _state.meter_provider is not None:
        return Telemetry(_state.tracer_provider, _state.meter_provider)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Telemetry()
    theirs_tracer = trace.get_tracer_provider()
    theirs_meter = metrics.get_meter_provider()
    adopt_tracer = isinstance(theirs_tracer, TracerProvider) and theirs_tracer not in _ours
    adopt_meter = isinstance(theirs_meter, MeterProvider) and theirs_meter not in _ours
    if adopt_tracer or adopt_meter:
        return install(
            tracer_provider=theirs_tracer if adopt_tracer else None,  # type: ignore[arg-type]
            meter_provider=theirs_meter if adopt_meter else None,  # type: ignore[arg-type]
        )

    span_exporters = _span_exporters(env)
    readers, closers = _metric_readers(env, metrics_host_of(env, metrics_host, http_host))
    if not span_exporters and not readers:
        return Telemetry()
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    tracer_provider = None
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER
        for exporter in span_exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        _ours.append(tracer_provider)
        trace.set_tracer_provider(tracer_provider)
    meter_provider = None
    if readers:
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        _ours.append(meter_provider)
        metrics.set_meter_provider(meter_provider)
    names = [type(e).__name__ for e in span_exporters] + [type(r).__name__ for r in readers]
    log.info("telemetry: %s", ", ".join(names))
    return install(
        tracer_provider=tracer_provider, meter_provider=meter_provider, owned=True, closers=closers
    )


def _exporter_names(env: Mapping[str, str], variable: str, signal: str) -> list[str]:
    raw = env.get(variable)
    if raw is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
            f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    return [] if "none" in names else names


def _grpc(env: Mapping[str, str], signal: str) -> bool:
    """Whether OTLP goes over gRPC (a Collector's port 4317) rather than HTTP (4318)."""
    protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol not in ("http/protobuf", "grpc"):
        raise TelemetryError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: lapse exports OTLP over http/protobuf "
            "(a Collector listens for it on port 4318) or grpc (port 4317)"
        )
    return protocol == "grpc"


def _span_exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for name in _exporter_names(env, "OTEL_TRACES_EXPORTER", "TRACES"):
        if name == "otlp" and _grpc(env, "TRACES"):
            from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_traces

            exporters.append(grpc_traces.OTLPSpanExporter())
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            raise TelemetryError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}")
    return exporters


# Where LAPSE_PROMETHEUS_PORT listens when neither LAPSE_PROMETHEUS_HOST nor the process
# says: a pod's (the policy watcher's), reached by the cluster's Prometheus.
POD_METRICS_HOST = "0.0.0.0"


def metrics_host_of(
    env: Mapping[str, str], chosen: str | None = None, http_host: str | None = None
) -> str:
    """Where LAPSE_PROMETHEUS_PORT listens: `chosen` (a flag), else LAPSE_PROMETHEUS_HOST,
    else `http_host` (the process's HTTP address), else every address."""
    return chosen or env.get("LAPSE_PROMETHEUS_HOST") or http_host or POD_METRICS_HOST


def _metric_readers(
    env: Mapping[str, str], host: str = POD_METRICS_HOST
) -> tuple[list[MetricReader], list[Callable[[], None]]]:
    readers: list[MetricReader] = []
    scrape: tuple[str, int] | None = None
    if port := env.get("LAPSE_PROMETHEUS_PORT"):
        scrape = (host, _port("LAPSE_PROMETHEUS_PORT", port))
    for name in _exporter_names(env, "OTEL_METRICS_EXPORTER", "METRICS"):
        if name == "otlp" and _grpc(env, "METRICS"):
            from opentelemetry.exporter.otlp.proto.grpc import metric_exporter as grpc_metrics

            readers.append(PeriodicExportingMetricReader(grpc_metrics.OTLPMetricExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "prometheus":
            port = env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464")
            otel_host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
            scrape = scrape or (otel_host, _port("OTEL_EXPORTER_PROMETHEUS_PORT", port))
        else:
            raise TelemetryError(f"OTEL_METRICS_EXPORTER: unknown exporter {name!r}")
    if scrape is None:
        return readers, []
    reader, close = _prometheus(*scrape)
    return [*readers, reader], [close]


def _port(variable: str, value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise TelemetryError(f"{variable}={value!r} is not a TCP port")
    return port


def _prometheus(host: str, port: int) -> tuple[MetricReader, Callable[[], None]]:
    # Imported here: only a process that serves a scrape endpoint needs the package.
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    # A registry of its own: the process-wide one accepts a collector once, and a process
    # that configures again after a shutdown (tests, a restarted function) would fail.
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise TelemetryError(f"cannot serve metrics on {host}:{port}: {exc}") from None
    log.info("telemetry: Prometheus metrics on http://%s:%d/metrics", host, port)

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return reader, close
