"""OpenTelemetry for lapse: traces across the delay, metrics, and their set-up.

- `names`: every span attribute and metric name (the one place they are documented);
- `providers`: which tracer and meter lapse uses; `configure()` from the OTEL_* environment
  (nothing configured: no SDK, no network traffic), `install()`/`install_in_memory()`;
- `spans`: the spans of each hop and the CloudEvent's own trace context;
- `handling`: a handler call's span, outcome and metrics (`InstrumentedHandler`);
- `tree`: `render_trace_tree(spans)` for a terminal (`spans_of_run` picks one run's).
"""

from lapse.telemetry.handling import (
    HandledOutcome,
    InstrumentedHandler,
    count_artifacts_deleted,
    count_database_statement,
    count_kubernetes_request,
    handled_outcome,
    record_dead_letter,
    record_retry,
)
from lapse.telemetry.instruments import (
    observe_backlog,
    observe_reconciled,
    observe_waiting,
    observe_watch_leases,
)
from lapse.telemetry.names import METRICS, MetricSpec
from lapse.telemetry.providers import (
    InMemoryTelemetry,
    Telemetry,
    TelemetryError,
    configure,
    install,
    install_in_memory,
    metrics_enabled,
    reset,
    tracer,
    tracing_enabled,
)
from lapse.telemetry.spans import (
    HopContext,
    client_span,
    delivery_parent,
    end_client_span,
    event_attributes,
    process_span,
    send_span,
    server_span,
    span_context_of,
    subject_template,
)
from lapse.telemetry.tree import render_trace_tree, spans_of_run

__all__ = [
    "METRICS",
    "HandledOutcome",
    "HopContext",
    "InMemoryTelemetry",
    "InstrumentedHandler",
    "MetricSpec",
    "Telemetry",
    "TelemetryError",
    "client_span",
    "configure",
    "count_artifacts_deleted",
    "count_database_statement",
    "count_kubernetes_request",
    "delivery_parent",
    "end_client_span",
    "event_attributes",
    "handled_outcome",
    "install",
    "install_in_memory",
    "metrics_enabled",
    "observe_backlog",
    "observe_reconciled",
    "observe_waiting",
    "observe_watch_leases",
    "process_span",
    "record_dead_letter",
    "record_retry",
    "render_trace_tree",
    "reset",
    "send_span",
    "server_span",
    "span_context_of",
    "spans_of_run",
    "subject_template",
    "tracer",
    "tracing_enabled",
]
