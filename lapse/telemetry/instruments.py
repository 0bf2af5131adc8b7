"""The metric instruments of `names.METRICS`, made from one Meter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

from lapse.telemetry.names import (
    ARTIFACTS_DELETED,
    ARTIFACTS_FREED,
    DATABASE_STATEMENTS,
    DELETION_CALLS,
    DELETIONS,
    DLQ_DEPTH,
    FUNCTION,
    HANDLER_DURATION,
    INGRESS_REJECTIONS,
    KUBERNETES_REQUESTS,
    LATENESS_SECONDS,
    OUTAGE_SECONDS,
    PENDING,
    RECONCILE_DURATION,
    RECONCILE_LAST_SUCCESS,
    RECONCILE_RUNS,
    RETRIES,
    SCHEDULE_CHANGES,
    TARGET,
    WAITING,
    WATCH_LEASES,
    WATCHED_KIND,
    MetricSpec,
)


@dataclass
class _Backlog:
    """The last values read from the streams; the observable gauges report these, because
    their callbacks run synchronously where the NATS client cannot be awaited."""

    pending: dict[str, int] = field(default_factory=dict)
    dlq: int | None = None
    # function -> (events waiting out a transient failure, seconds it has lasted)
    waiting: dict[str, tuple[int, float]] = field(default_factory=dict)
    # When the safety net's last pass without an error ended (Unix time).
    reconciled: float | None = None
    # The kinds whose watch lease this process holds (lapse.runtime.watch_lease).
    leases: tuple[str, ...] = ()


_backlog = _Backlog()


def observe_backlog(pending: Mapping[str, int], dlq: int) -> None:
    """Record what the streams hold now: pending schedules per target, dead letters."""
    _backlog.pending = dict(pending)
    _backlog.dlq = dlq


def observe_waiting(function: str, count: int, seconds: float) -> None:
    """Record how many events `function` waits to retry, and for how long it has."""
    _backlog.waiting[function] = (count, seconds)


def observe_reconciled(when: float) -> None:
    """Record when the safety net's last pass without an error ended."""
    _backlog.reconciled = when


def observe_watch_leases(kinds: Iterable[str]) -> None:
    """Record the kinds whose watch this process runs now (their lease held)."""
    _backlog.leases = tuple(kinds)


def _leases(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(1, {WATCHED_KIND: kind}) for kind in _backlog.leases]


def _reconciled(_: CallbackOptions) -> Iterable[Observation]:
    return [] if _backlog.reconciled is None else [Observation(_backlog.reconciled)]


def _waiting(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(n, {FUNCTION: f}) for f, (n, _s) in _backlog.waiting.items()]


def _outage(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(s, {FUNCTION: f}) for f, (_n, s) in _backlog.waiting.items()]


def _pending(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(count, {TARGET: target}) for target, count in _backlog.pending.items()]


def _dlq(_: CallbackOptions) -> Iterable[Observation]:
    return [] if _backlog.dlq is None else [Observation(_backlog.dlq)]


class Instruments:
    def __init__(self, meter: Meter) -> None:
        def counter(spec: MetricSpec) -> Counter:
            return meter.create_counter(spec.name, spec.unit, spec.description)

        def histogram(spec: MetricSpec) -> Histogram:
            return meter.create_histogram(
                spec.name,
                spec.unit,
                spec.description,
                explicit_bucket_boundaries_advisory=spec.buckets,
            )

        self.deletions = counter(DELETIONS)
        self.lateness = histogram(LATENESS_SECONDS)
        self.schedule_changes = counter(SCHEDULE_CHANGES)
        self.retries = counter(RETRIES)
        self.deletion_calls = histogram(DELETION_CALLS)
        self.kubernetes_requests = counter(KUBERNETES_REQUESTS)
        self.database_statements = counter(DATABASE_STATEMENTS)
        self.artifacts_deleted = counter(ARTIFACTS_DELETED)
        self.artifacts_freed = counter(ARTIFACTS_FREED)
        self.handler_duration = histogram(HANDLER_DURATION)
        self.ingress_rejections = counter(INGRESS_REJECTIONS)
        self.reconcile_runs = counter(RECONCILE_RUNS)
        self.reconcile_duration = histogram(RECONCILE_DURATION)
        meter.create_observable_gauge(PENDING.name, [_pending], PENDING.unit, PENDING.description)
        meter.create_observable_gauge(DLQ_DEPTH.name, [_dlq], DLQ_DEPTH.unit, DLQ_DEPTH.description)
        meter.create_observable_gauge(WAITING.name, [_waiting], WAITING.unit, WAITING.description)
        meter.create_observable_gauge(
            OUTAGE_SECONDS.name, [_outage], OUTAGE_SECONDS.unit, OUTAGE_SECONDS.description
        )
        meter.create_observable_gauge(
            WATCH_LEASES.name, [_leases], WATCH_LEASES.unit, WATCH_LEASES.description
        )
        meter.create_observable_gauge(
            RECONCILE_LAST_SUCCESS.name,
            [_reconciled],
            RECONCILE_LAST_SUCCESS.unit,
            RECONCILE_LAST_SUCCESS.description,
        )
