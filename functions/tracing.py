"""What a handler needs to be traced, without depending on the runtime that traces it.

- `creation_context()`: the CloudEvent's own `traceparent`/`tracestate` (the
  distributed-tracing extension) = the span the event is being created in; pass it to
  `build_event(..., **creation_context())`.
- `step_span(name, attributes)`: an INTERNAL span for one step of a handler.
- The span attribute names the handlers set (the full catalogue, with metrics, is
  `lapse.telemetry.names`, which re-exports these).

Only the OpenTelemetry API is used. Which tracer records the steps is decided by the
process that runs the handler: `lapse.telemetry` installs its tracer here with
`use_tracer`; until then steps are not recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Final, TypedDict

from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from lapse.events.tracecontext import is_valid_traceparent, is_valid_tracestate

RUN_NAMESPACE: Final = "lapse.run.namespace"
RUN_NAME: Final = "lapse.run.name"
RUN_UID: Final = "lapse.run.uid"
RUN_ENGINE: Final = "lapse.run.engine"
TARGET: Final = "lapse.target"
DEADLINE: Final = "lapse.deadline"
POLICY: Final = "lapse.policy"
SCHEDULE_ACTION: Final = "lapse.schedule.action"  # created, replaced, unchanged, cancelled, none

_W3C: Final = TraceContextTextMapPropagator()
_tracer: Tracer | None = None


def use_tracer(tracer: Tracer | None) -> None:
    """Record handler steps with `tracer` (None: stop recording them)."""
    global _tracer
    _tracer = tracer


class TraceFields(TypedDict, total=False):
    traceparent: str
    tracestate: str


def creation_context() -> TraceFields:
    """The current span as CloudEvent trace fields; empty outside a trace."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    fields = TraceFields()
    if is_valid_traceparent(carrier.get("traceparent")):
        fields["traceparent"] = carrier["traceparent"]
        if is_valid_tracestate(carrier.get("tracestate")):
            fields["tracestate"] = carrier["tracestate"]
    return fields


@contextlib.contextmanager
def step_span(name: str, attributes: Mapping[str, AttributeValue]) -> Iterator[Span]:
    """An INTERNAL span for one step of a handler (a planner decision)."""
    tracer = _tracer
    if tracer is None:
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(name) as span:
        if span.is_recording():
            span.set_attributes(attributes)
        yield span
