"""The metric instruments of `names.METRICS`, made from one Meter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

from lapse.telemetry.names import (
    DATABASE_STATEMENTS,
    DELETION_CALLS,
    DELETIONS,
    DLQ_DEPTH,
    HANDLER_DURATION,
    INGRESS_REJECTIONS,
    KUBERNETES_REQUESTS,
    LATENESS_SECONDS,
    PENDING,
    RETRIES,
    SCHEDULE_CHANGES,
    TARGET,
    MetricSpec,
)


@dataclass
class _Backlog:
    """The last values read from the streams; the observable gauges report these, because
    their callbacks run synchronously where the NATS client cannot be awaited."""

    pending: dict[str, int] = field(default_factory=dict)
    dlq: int | None = None


_backlog = _Backlog()


def observe_backlog(pending: Mapping[str, int], dlq: int) -> None:
    """Record what the streams hold now: pending schedules per target, dead letters."""
    _backlog.pending = dict(pending)
    _backlog.dlq = dlq


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
        self.handler_duration = histogram(HANDLER_DURATION)
        self.ingress_rejections = counter(INGRESS_REJECTIONS)
        meter.create_observable_gauge(PENDING.name, [_pending], PENDING.unit, PENDING.description)
        meter.create_observable_gauge(DLQ_DEPTH.name, [_dlq], DLQ_DEPTH.unit, DLQ_DEPTH.description)
