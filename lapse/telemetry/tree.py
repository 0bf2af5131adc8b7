"""A run's traces as text, so a terminal shows the whole path without a tracing backend."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from lapse.telemetry import names

# The attributes worth a glance in a tree, and their short labels; the rest are one click
# away in a tracing backend.
_SHOWN: Final = (
    (names.RUN_NAMESPACE, "namespace"), (names.RUN_NAME, "name"), (names.TARGET, "target"),
    (names.SCHEDULE_ACTION, "action"), (names.DEADLINE, "deadline"),
    (names.OUTCOME, "outcome"), (names.LATENESS, "lateness"), (names.HTTP_STATUS, "status"),
    (names.DB_COLLECTION, "table"), (names.DELIVERY_ATTEMPT, "attempt"),
    (names.ERROR_TYPE, "error"),
)  # fmt: skip


def spans_of_run(spans: Iterable[ReadableSpan], uid: str) -> list[ReadableSpan]:
    """Every span of the traces that touched one run (a span there names its uid): the
    planner's and each reaper's, so `render_trace_tree` shows the run's whole path."""
    spans = list(spans)
    traces = {
        span.context.trace_id
        for span in spans
        if span.context is not None and (span.attributes or {}).get(names.RUN_UID) == uid
    }
    return [span for span in spans if span.context is not None and span.context.trace_id in traces]


def render_trace_tree(spans: Iterable[ReadableSpan]) -> str:
    """Finished spans as one indented tree per trace, oldest trace first.

    A span whose parent is not among `spans` is drawn as a root; links (a due event's
    processing points back to where it was scheduled) are shown on the linking span."""
    finished = [span for span in spans if span.context is not None]
    by_id = {span.context.span_id: span for span in finished if span.context is not None}
    children: dict[int, list[ReadableSpan]] = {}
    roots: dict[int, list[ReadableSpan]] = {}
    for span in finished:
        assert span.context is not None
        if span.parent is not None and span.parent.span_id in by_id:
            children.setdefault(span.parent.span_id, []).append(span)
        else:
            roots.setdefault(span.context.trace_id, []).append(span)

    lines: list[str] = []

    def draw(span: ReadableSpan, prefix: str, last: bool) -> None:
        lines.append(f"{prefix}{'└─ ' if last else '├─ '}{_describe(span, by_id)}")
        assert span.context is not None
        kids = sorted(children.get(span.context.span_id, []), key=_start)
        for index, kid in enumerate(kids):
            draw(kid, prefix + ("   " if last else "│  "), index == len(kids) - 1)

    for trace_id, tops in sorted(roots.items(), key=lambda item: min(map(_start, item[1]))):
        lines.append(f"trace {trace_id:032x}")
        tops.sort(key=_start)
        for index, span in enumerate(tops):
            draw(span, "", index == len(tops) - 1)
    return "\n".join(lines)


def _start(span: ReadableSpan) -> int:
    return span.start_time or 0


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}s"  # the only float shown is a lateness
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _describe(span: ReadableSpan, by_id: Mapping[int, ReadableSpan]) -> str:
    parts = [
        span.name if span.kind is SpanKind.INTERNAL else f"{span.name} [{span.kind.name.lower()}]"
    ]
    if span.start_time is not None and span.end_time is not None:
        parts.append(f"{(span.end_time - span.start_time) / 1e6:.1f} ms")
    attributes = span.attributes or {}
    shown = [f"{label}={_text(attributes[key])}" for key, label in _SHOWN if key in attributes]
    if shown:
        parts.append(" ".join(shown))
    if span.status.status_code is StatusCode.ERROR:
        parts.append("ERROR")
    for link in span.links:
        linked = by_id.get(link.context.span_id)
        kind = (link.attributes or {}).get(names.LINK_KIND, "link")
        what = f"'{linked.name}'" if linked is not None else f"span {link.context.span_id:016x}"
        parts.append(f"↪ {kind}: {what} in trace {link.context.trace_id:032x}")
    return "  ".join(parts)
