"""The spans of every hop: where a CloudEvent is created, sent, delivered and handled.

Two W3C contexts travel with an event: the CloudEvent's own `traceparent` extension, set
once where the event is created and never overwritten (`creation_context`), and the hop's,
in the transport's `traceparent` header, set by whoever sent it (`send_span`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from cloudevents.core.base import BaseCloudEvent
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from lapse.events.tracecontext import is_valid_traceparent
from lapse.events.types import EventType
from lapse.functions.tracing import creation_context
from lapse.telemetry import names
from lapse.telemetry.providers import tracer, tracing_enabled

# Processed after a delay of hours or days: a parent that old would make a meaningless trace.
DELAYED_EVENT_TYPES: Final = frozenset({EventType.CLEANUP_DUE})
# Subjects whose last token is a run uid: one span name per target, not one per run.
_PER_RUN_SUBJECT: Final = re.compile(r"^(lapse\.(?:sched|due)\.[^.]+)\.[^.]+$")
_W3C: Final = TraceContextTextMapPropagator()


def span_context_of(traceparent: str | None, tracestate: str | None = None) -> SpanContext | None:
    """The remote span a W3C traceparent names; None when absent or invalid."""
    if traceparent is None or not is_valid_traceparent(traceparent):
        return None
    carrier = {"traceparent": traceparent}
    if tracestate is not None:
        carrier["tracestate"] = tracestate
    span_context = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def event_creation(event: BaseCloudEvent) -> SpanContext | None:
    """Where the event was created (its `traceparent` extension)."""
    traceparent = event.get_extension("traceparent")
    tracestate = event.get_extension("tracestate")
    return span_context_of(
        traceparent if isinstance(traceparent, str) else None,
        tracestate if isinstance(tracestate, str) else None,
    )


def delivery_parent(
    event_type: str | None, hop: SpanContext | None, creation: SpanContext | None
) -> tuple[SpanContext | None, list[Link]]:
    """The parent and the links of the span that processes one delivered event.

    Normally the hop is the parent (the creation context when the transport carried
    none) and the creation context is linked. A delayed event starts a new trace that links
    to both, unless its hop context began after the delay, in a trace other than the
    creation's (a forwarder that picked the due message up): that one is a fitting parent.
    """
    parent: SpanContext | None
    if event_type in DELAYED_EVENT_TYPES:
        fresh = hop is not None and (creation is None or hop.trace_id != creation.trace_id)
        parent = hop if fresh else None
    else:
        parent = hop or creation
    links: list[Link] = []
    for kind, candidate in (("hop", hop), ("creation", creation)):
        if candidate is None or candidate == parent:
            continue
        if any(link.context.span_id == candidate.span_id for link in links):
            continue
        links.append(Link(candidate, {names.LINK_KIND: kind}))
    return parent, links


def subject_template(subject: str) -> str:
    """`lapse.due.kubernetes.<uid>` -> `lapse.due.kubernetes.*`; other subjects as they are."""
    match = _PER_RUN_SUBJECT.match(subject)
    return f"{match.group(1)}.*" if match else subject


def event_attributes(event: BaseCloudEvent) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        names.CE_ID: event.get_id(),
        names.CE_SOURCE: event.get_source(),
        names.CE_TYPE: event.get_type(),
        names.CE_SPEC_VERSION: event.get_specversion(),
    }
    if (subject := event.get_subject()) is not None:
        attributes[names.CE_SUBJECT] = subject
    return attributes


def _messaging(
    operation: str, subject: str, event: BaseCloudEvent | None
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        names.MESSAGING_SYSTEM: names.NATS,
        names.MESSAGING_OPERATION_TYPE: operation,
        names.MESSAGING_OPERATION_NAME: operation,
        names.MESSAGING_DESTINATION: subject,
    }
    if (template := subject_template(subject)) != subject:
        attributes[names.MESSAGING_TEMPLATE] = template
    if event is not None:
        attributes[names.MESSAGING_MESSAGE_ID] = event.get_id()
        attributes.update(event_attributes(event))
    return attributes


@dataclass(frozen=True)
class HopContext:
    """This hop's W3C context, for the transport's own `traceparent` header."""

    traceparent: str | None = None
    tracestate: str | None = None


@contextlib.contextmanager
def send_span(subject: str, event: BaseCloudEvent) -> Iterator[HopContext]:
    """PRODUCER `send <subject>` around one publish; yields the context for its headers."""
    if not tracing_enabled():
        yield HopContext()
        return
    with tracer().start_as_current_span(
        f"send {subject_template(subject)}", kind=SpanKind.PRODUCER
    ) as span:
        if span.is_recording():
            span.set_attributes(_messaging("send", subject, event))
        fields = creation_context()
        yield HopContext(fields.get("traceparent"), fields.get("tracestate"))


@contextlib.contextmanager
def process_span(
    subject: str,
    event: BaseCloudEvent | None,
    hop: tuple[str | None, str | None],
    *,
    subscription: str | None = None,
    attempt: int | None = None,
) -> Iterator[Span]:
    """CONSUMER `process <subject>` for one NATS delivery (parent and links: see
    `delivery_parent`). `event` is None when the message is not a CloudEvent."""
    if not tracing_enabled():
        yield trace.INVALID_SPAN
        return
    parent, links = delivery_parent(
        event.get_type() if event is not None else None,
        span_context_of(*hop),
        event_creation(event) if event is not None else None,
    )
    with tracer().start_as_current_span(
        f"process {subject_template(subject)}",
        context=_context_of(parent),
        kind=SpanKind.CONSUMER,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        if span.is_recording():
            span.set_attributes(_messaging("process", subject, event))
            if subscription is not None:
                span.set_attribute(names.MESSAGING_SUBSCRIPTION, subscription)
            if attempt is not None:
                span.set_attribute(names.DELIVERY_ATTEMPT, attempt)
        yield span


@contextlib.contextmanager
def server_span(
    event: BaseCloudEvent, headers: Iterable[tuple[bytes, bytes]], *, method: str, path: str
) -> Iterator[Span]:
    """SERVER `<METHOD> <path>` for one HTTP delivery, from the request's traceparent.

    Written by hand: the ASGI instrumentation cannot wrap a func-python function."""
    if not tracing_enabled():
        yield trace.INVALID_SPAN
        return
    fields = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in headers}
    parent, links = delivery_parent(
        event.get_type(),
        span_context_of(fields.get("traceparent"), fields.get("tracestate")),
        event_creation(event),
    )
    with tracer().start_as_current_span(
        f"{method} {path}",
        context=_context_of(parent),
        kind=SpanKind.SERVER,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        if span.is_recording():
            span.set_attributes(
                {names.HTTP_METHOD: method, names.HTTP_ROUTE: path, names.URL_PATH: path}
            )
            span.set_attributes(event_attributes(event))
        yield span


def _context_of(parent: SpanContext | None) -> otel_context.Context:
    # An empty Context rather than None: None means "whatever is current", and a delivery
    # must not inherit the consuming task's context.
    if parent is None:
        return otel_context.Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), otel_context.Context())


def client_span(name: str, attributes: Mapping[str, AttributeValue]) -> Span | None:
    """Start (not enter) a CLIENT span for a call made inside a trace; None outside one.

    Outside a handling (start-up reflection, the watcher's LIST) every request would be a
    trace of its own, burying the traces that matter."""
    if not tracing_enabled() or not trace.get_current_span().get_span_context().is_valid:
        return None
    return tracer().start_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def end_client_span(
    span: Span | None, *, status: int | None = None, error: str | None = None
) -> None:
    """End a `client_span`: `status` is the HTTP status, `error` the error.type if failed."""
    if span is None:
        return
    if span.is_recording():
        if status is not None:
            span.set_attribute(names.HTTP_STATUS, status)
        if error is not None:
            span.set_attribute(names.ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR))
    span.end()
