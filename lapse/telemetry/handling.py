"""One handler call as telemetry: its span, its outcome, and the metrics of what it did."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from lapse.events.types import EventType
from lapse.functions.ports import Handler, RetryLater
from lapse.functions.trust import Trust
from lapse.telemetry import names
from lapse.telemetry.providers import instruments, metrics_enabled, tracer, tracing_enabled
from lapse.telemetry.spans import event_attributes


@dataclass
class _Tally:
    kubernetes: int = 0
    database: int = 0


# Per handler call (asyncio tasks copy contexts, SQLAlchemy's greenlets share them).
_tally: ContextVar[_Tally | None] = ContextVar("lapse_call_tally", default=None)


def count_kubernetes_request(method: str, status: int | None) -> None:
    if not metrics_enabled():
        return
    if (tally := _tally.get()) is not None:
        tally.kubernetes += 1
    attributes: dict[str, AttributeValue] = {names.HTTP_METHOD: method}
    if status is not None:
        attributes[names.HTTP_STATUS] = status
    instruments().kubernetes_requests.add(1, attributes)


def count_database_statement(operation: str) -> None:
    if not metrics_enabled():
        return
    if (tally := _tally.get()) is not None:
        tally.database += 1
    instruments().database_statements.add(1, {names.DB_OPERATION: operation})


def count_artifacts_deleted(store: str, objects: int, size: int) -> None:
    """Objects deleted from one store and the bytes they held."""
    if not metrics_enabled():
        return
    attributes = {names.ARTIFACT_STORE: store}
    instruments().artifacts_deleted.add(objects, attributes)
    instruments().artifacts_freed.add(size, attributes)


@dataclass(frozen=True)
class HandledOutcome:
    target: str
    outcome: str  # a cleanup.completed outcome, or "failed"
    lateness: float | None


def _data(event: BaseCloudEvent) -> Mapping[str, Any]:
    # Read from the wire form (camelCase): validating the model again would cost more
    # than the span it annotates.
    data = event.get_data()
    return data if isinstance(data, Mapping) else {}


def handled_outcome(produced: Sequence[BaseCloudEvent]) -> HandledOutcome | None:
    """What handling one due event came to: its completion (the last one: a brake alert
    precedes the reschedule), else its failure; None when it produced neither."""
    failed: HandledOutcome | None = None
    for event in reversed(produced):
        data = _data(event)
        target = data.get("target")
        if not isinstance(target, str):
            continue
        outcome = data.get("outcome")
        if event.get_type() == EventType.CLEANUP_COMPLETED and isinstance(outcome, str):
            lateness = data.get("latencySeconds")
            seconds = float(lateness) if isinstance(lateness, int | float) else None
            return HandledOutcome(target, outcome, seconds)
        if event.get_type() == EventType.CLEANUP_FAILED and failed is None:
            failed = HandledOutcome(target, "failed", None)
    return failed


def run_attributes(data: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """The run and target an event's payload names, as span attributes."""
    attributes: dict[str, AttributeValue] = {}
    run = data.get("run")
    if isinstance(run, Mapping):
        for key, field in (
            (names.RUN_NAMESPACE, "namespace"),
            (names.RUN_NAME, "name"),
            (names.RUN_UID, "uid"),
            (names.RUN_ENGINE, "engine"),
        ):
            if isinstance(value := run.get(field), str):
                attributes[key] = value
    for key, field in (
        (names.TARGET, "target"),
        (names.DEADLINE, "deadline"),
        (names.POLICY, "policy"),
    ):
        if isinstance(value := data.get(field), str):
            attributes[key] = value
    return attributes


@dataclass
class _Call:
    """One handler call being measured: its span, the requests made inside it, and how the
    call ended (`handler_duration`'s result)."""

    span: Span
    tally: _Tally
    result: str = "error"


@contextmanager
def _function_span(
    function: str, ce_type: str | None, attributes: Callable[[], Mapping[str, AttributeValue]]
) -> Iterator[_Call]:
    """The function span around one call of a handler (one event or a batch), with the
    Kubernetes requests and database statements made inside it tallied, and the call's
    duration recorded when it ends (none for an empty batch: `ce_type` None). `attributes`
    is called only for a span that records (reading the payload costs per event)."""
    tally = _Tally()
    token = _tally.set(tally)
    started = time.perf_counter()
    call: _Call | None = None
    try:
        with tracer().start_as_current_span(
            function, record_exception=False, set_status_on_exception=False
        ) as span:
            call = _Call(span, tally)
            if span.is_recording():
                span.set_attribute(names.FUNCTION, function)
                span.set_attributes(attributes())
            yield call
            call.result = "ok"
    except RetryLater:
        if call is not None:
            call.result = "retry"
        raise
    finally:
        _tally.reset(token)
        if ce_type is not None:
            instruments().handler_duration.record(
                time.perf_counter() - started,
                {names.FUNCTION: function, names.CE_TYPE: ce_type,
                 names.HANDLER_RESULT: call.result if call is not None else "error"},
            )  # fmt: skip


class InstrumentedHandler:
    """A handler inside its function span, with the metrics of what it did.

    The span carries the run (namespace, name, uid), the target and, for a due event, the
    outcome and lateness; Kubernetes requests and database statements made meanwhile are
    its children, and are counted per deletion."""

    def __init__(self, function: str, handler: Handler) -> None:
        self.function = function
        self.inner = handler

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        if not tracing_enabled() and not metrics_enabled():
            produced = await self.inner.handle(event, trust)
            log_deletion(event, produced)
            return produced

        def attributes() -> dict[str, AttributeValue]:
            return {**event_attributes(event), **run_attributes(_data(event))}

        with _function_span(self.function, event.get_type(), attributes) as call:
            produced = await self._call(event, trust, call.span)
            self._observe(event, produced, call.span, call.tally)
        return produced

    async def _call(self, event: BaseCloudEvent, trust: Trust, span: Span) -> list[BaseCloudEvent]:
        try:
            return await self.inner.handle(event, trust)
        except RetryLater as exc:
            # Not an error: the runtime delivers the event again later.
            span.add_event("retry later", {names.RETRY_REASON: exc.reason[:256]})
            raise
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute(names.ERROR_TYPE, type(exc).__qualname__)
            raise

    def _observe(
        self, event: BaseCloudEvent, produced: Sequence[BaseCloudEvent], span: Span, tally: _Tally
    ) -> None:
        log_deletion(event, produced)
        _record_schedules(produced)
        if event.get_type() != EventType.CLEANUP_DUE:
            return
        outcome = handled_outcome(produced)
        if outcome is None:
            return
        _record_outcome(outcome, tally)
        if span.is_recording():
            span.set_attribute(names.OUTCOME, outcome.outcome)
            if outcome.lateness is not None:
                span.set_attribute(names.LATENESS, outcome.lateness)


class InstrumentedBatchHandler(InstrumentedHandler):
    """`InstrumentedHandler` for a handler that also takes batches (the row-reaper's
    `handle_batch`, which `lapse up`'s dispatcher calls with a fetch): one function span
    for the batch, and per event the deletion log line, the schedules and the outcome
    metrics `handle` records (the batch's database statements shared out among them)."""

    async def handle_batch(
        self, events: Sequence[tuple[BaseCloudEvent, Trust]]
    ) -> list[list[BaseCloudEvent] | Exception]:
        inner: Any = self.inner
        if not tracing_enabled() and not metrics_enabled():
            answers: list[list[BaseCloudEvent] | Exception] = await inner.handle_batch(events)
            for (event, _), answer in zip(events, answers, strict=False):
                if not isinstance(answer, Exception):
                    log_deletion(event, answer)
            return answers
        ce_type = events[0][0].get_type() if events else None
        size = {"lapse.batch_size": len(events)}
        with _function_span(self.function, ce_type, lambda: size) as call:
            answers = await inner.handle_batch(events)
        share = _Tally(
            kubernetes=call.tally.kubernetes // max(len(events), 1),
            database=call.tally.database // max(len(events), 1),
        )
        for (event, _), answer in zip(events, answers, strict=False):
            if isinstance(answer, Exception):
                continue
            log_deletion(event, answer)
            _record_schedules(answer)
            if event.get_type() == EventType.CLEANUP_DUE:
                outcome = handled_outcome(answer)
                if outcome is not None:
                    _record_outcome(outcome, share)
        return answers


def instrumented(function: str, handler: Handler) -> InstrumentedHandler:
    """`handler` inside its function span with its metrics; one that takes batches keeps
    taking them."""
    if callable(getattr(handler, "handle_batch", None)):
        return InstrumentedBatchHandler(function, handler)
    return InstrumentedHandler(function, handler)


# One INFO line per deletion (and per deletion a dry-run skipped): what an operator greps
# for, and with `--log-format json` the same facts as fields.
deletions_log = logging.getLogger("lapse.deletions")
# Outcomes that are a deletion, made or (dry-run) withheld.
_LOGGED_OUTCOMES = {"deleted": "deleted", "dry_run": "would delete (dry-run)"}


def log_deletion(event: BaseCloudEvent, produced: Sequence[BaseCloudEvent]) -> None:
    """`deleted Workflow team-a/train (uid ..., target kubernetes, policy
    annotation:lapse.dev/ttl, 0.067s late)`, from the due event (the policy that set the
    deadline) and the completion the reaper produced."""
    if event.get_type() != EventType.CLEANUP_DUE or not deletions_log.isEnabledFor(logging.INFO):
        return
    completed = next(
        (e for e in reversed(produced) if e.get_type() == EventType.CLEANUP_COMPLETED), None
    )
    if completed is None:
        return
    data = _data(completed)
    verb = _LOGGED_OUTCOMES.get(str(data.get("outcome")))
    if verb is None:
        return
    run = data.get("run")
    if not isinstance(run, Mapping):
        run = {}
    lateness = data.get("latencySeconds")
    fields: dict[str, Any] = {
        "outcome": data.get("outcome"),
        "target": data.get("target"),
        "kind": run.get("kind"),
        "namespace": run.get("namespace"),
        "name": run.get("name"),
        "uid": run.get("uid"),
        "policy": _data(event).get("policy"),
        "lateness_seconds": lateness if isinstance(lateness, int | float) else None,
    }
    what = "rows of" if fields["target"] == "database" else ""
    late = f", {lateness:.3f}s late" if isinstance(lateness, int | float) else ""
    deletions_log.info(
        "%s %s%s %s/%s (uid %s, target %s, policy %s%s)",
        verb,
        f"{what} " if what else "",
        fields["kind"],
        fields["namespace"],
        fields["name"],
        fields["uid"],
        fields["target"],
        fields["policy"],
        late,
        extra={"fields": fields},
    )


def _record_outcome(outcome: HandledOutcome, tally: _Tally) -> None:
    meter = instruments()
    meter.deletions.add(1, {names.TARGET: outcome.target, names.OUTCOME: outcome.outcome})
    if outcome.outcome == "deleted" and outcome.lateness is not None:
        meter.lateness.record(outcome.lateness, {names.TARGET: outcome.target})
    for api, calls in (("kubernetes", tally.kubernetes), ("database", tally.database)):
        if calls or api == outcome.target:
            meter.deletion_calls.record(
                calls,
                {names.TARGET: outcome.target, names.OUTCOME: outcome.outcome, names.API: api},
            )


def _record_schedules(produced: Sequence[BaseCloudEvent]) -> None:
    for event in produced:
        data = _data(event)
        target = data.get("target")
        if not isinstance(target, str):
            continue
        if event.get_type() == EventType.CLEANUP_SCHEDULED:
            action = "replaced" if data.get("replaced") else "created"
        elif event.get_type() == EventType.CLEANUP_CANCELLED:
            action = "cancelled"
        else:
            continue
        instruments().schedule_changes.add(1, {names.TARGET: target, names.SCHEDULE_ACTION: action})


def record_retry(function: str, error_type: str) -> None:
    instruments().retries.add(1, {names.FUNCTION: function, names.ERROR_TYPE: error_type})


def record_dead_letter(event: BaseCloudEvent | None) -> None:
    """A due event given up on after its last try is a deletion that failed."""
    if event is None or event.get_type() != EventType.CLEANUP_DUE:
        return
    target = _data(event).get("target")
    if isinstance(target, str):
        instruments().deletions.add(1, {names.TARGET: target, names.OUTCOME: "failed"})
