"""The row-reaper handler: `cleanup.due` (target=database) in, `cleanup.completed` out.

- Each run's key per target comes from the run reference in the due event (KFP run id,
  uid, name, a label or an annotation); a target the run has no key for is skipped.
- Rows are deleted in one transaction per run (`handle`) or per batch of runs
  (`handle_batch`); the outcome is `deleted` (detail: rows per table), `already_gone` when
  no row existed (so a redelivered event deletes nothing more), or `dry_run`.
- The database being unreachable (or asking us to back off) raises `RetryLater`: nothing
  was committed, the runtime delivers the event again.
- Input that cannot be used, or a run the database refuses for good, becomes
  `cleanup.failed` with the reason.
- Every outcome carries the trace context it was made in (`creation_context`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final

from cloudevents.core.base import BaseCloudEvent

from events.builder import build_event, outcome_id, parse_payload
from events.errors import InvalidEvent
from events.models import CleanupCompleted, CleanupDue, CleanupFailed, clip
from events.original import capture_event
from events.run import Target
from events.types import EventType, Outcome
from functions.ports import Emitter, RetryLater, emit_all
from functions.row_reaper.ports import Counted, Rejected, RowStore, RunResult, Unavailable
from functions.row_reaper.targets import RunKeys, keys_for
from functions.tracing import creation_context

SOURCE: Final = "/lapse/row-reaper"
STAGE: Final = "row-reaper"
# The scheduler fires at the deadline; a due event earlier than this is a clock-skewed or
# hand-made one, and rows deleted early cannot be brought back.
EARLY_TOLERANCE: Final = timedelta(seconds=1)


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Retry:
    event: BaseCloudEvent
    reason: str
    delay: float


class BatchRetryLater(RetryLater):
    """Some events of a batch must be delivered again (`retries`); all others are done and
    their outcomes were emitted (`emitted`). A runtime that only knows `RetryLater` may
    redeliver the whole batch: the finished runs then report `already_gone`."""

    def __init__(self, retries: Sequence[Retry], emitted: Sequence[BaseCloudEvent]) -> None:
        first = min(retries, key=lambda r: r.delay)
        more = f" (and {len(retries) - 1} more)" if len(retries) > 1 else ""
        super().__init__(first.reason + more, first.delay)
        self.retries = tuple(retries)
        self.emitted = tuple(emitted)


@dataclass(frozen=True)
class _Work:
    event: BaseCloudEvent
    due: CleanupDue
    keys: RunKeys


@dataclass(frozen=True)
class RowReaper:
    rows: RowStore
    emitter: Emitter
    dry_run: bool = False
    # Runs per transaction in `handle_batch`; bounds statement size and lock time.
    batch_size: int = 500
    retry_delay: float = 5.0
    clock: Callable[[], datetime] = field(default=_utcnow)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")

    async def handle(self, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        """One due event, one transaction; returns the events it emitted."""
        try:
            return await self.handle_batch([event])
        except BatchRetryLater as exc:
            raise RetryLater(exc.reason, exc.delay) from None

    async def handle_batch(self, events: Sequence[BaseCloudEvent]) -> list[BaseCloudEvent]:
        """Many due events, `batch_size` runs per transaction; returns the events emitted.

        Raises `BatchRetryLater` naming the events to deliver again, after emitting the
        outcomes of all the others. Each outcome is emitted once its transaction committed.
        """
        now = self.clock()
        work: list[_Work] = []
        retries: list[Retry] = []
        ready: list[BaseCloudEvent] = []
        for event in events:
            try:
                due = parse_payload(event, CleanupDue)
            except InvalidEvent as exc:
                failed = CleanupFailed(
                    reason=exc.reason, stage=STAGE, original=capture_event(event)
                )
                ready.append(
                    build_event(
                        EventType.CLEANUP_FAILED, source=SOURCE, data=failed, **creation_context()
                    )
                )
                continue
            if due.target is not Target.DATABASE:
                continue  # the object-reaper's; a subscription without a target filter
            early = due.deadline - now
            if early > EARLY_TOLERANCE:
                retries.append(Retry(event, "not due yet", early.total_seconds()))
                continue
            keys = keys_for(due.run, self.rows.targets)
            if keys.keys:
                work.append(_Work(event, due, keys))
            else:
                ready.append(self._completed(event, due, Counted(()), keys.skipped))
        emitted = await emit_all(self.emitter, ready)

        down: str | None = None
        for chunk in _chunks(work, self.batch_size):
            if down is not None:
                retries.extend(Retry(w.event, down, self.retry_delay) for w in chunk)
                continue
            results = await self.rows.delete([w.keys.keys for w in chunk], dry_run=self.dry_run)
            outcomes = []
            for item, result in zip(chunk, results, strict=True):
                if isinstance(result, Unavailable):
                    retries.append(Retry(item.event, result.reason, self.retry_delay))
                    down = result.reason
                else:
                    outcomes.append(self._outcome(item, result))
            # A whole chunk that could not commit means the database is down or stuck:
            # leave the rest for redelivery instead of waiting on it once per chunk.
            if outcomes:
                down = None
            emitted += await emit_all(self.emitter, outcomes)
        if retries:
            raise BatchRetryLater(retries, emitted)
        return emitted

    def _outcome(self, item: _Work, result: RunResult) -> BaseCloudEvent:
        if isinstance(result, Rejected):
            failed = CleanupFailed(
                run=item.due.run,
                target=Target.DATABASE,
                reason=result.reason,
                stage=STAGE,
                original=capture_event(item.event),
            )
            return build_event(
                EventType.CLEANUP_FAILED,
                source=SOURCE,
                data=failed,
                id=outcome_id(item.event.get_id(), EventType.CLEANUP_FAILED),
                **creation_context(),
            )
        assert isinstance(result, Counted)
        return self._completed(item.event, item.due, result, item.keys.skipped)

    def _completed(
        self,
        event: BaseCloudEvent,
        due: CleanupDue,
        counted: Counted,
        skipped: Mapping[str, str],
    ) -> BaseCloudEvent:
        """The outcome of `event`; its id is derived from the due event's (one outcome)."""
        if self.dry_run:
            outcome = Outcome.DRY_RUN
        elif counted.total > 0:
            outcome = Outcome.DELETED
        else:
            outcome = Outcome.ALREADY_GONE
        completed = CleanupCompleted.of(
            run=due.run,
            target=Target.DATABASE,
            outcome=outcome,
            completed_at=self.clock(),
            deadline=due.deadline,
            detail=describe(counted, skipped, dry_run=self.dry_run),
            dry_run=self.dry_run,
        )
        return build_event(
            EventType.CLEANUP_COMPLETED,
            source=SOURCE,
            data=completed,
            id=outcome_id(event.get_id(), EventType.CLEANUP_COMPLETED),
            **creation_context(),
        )


def describe(counted: Counted, skipped: Mapping[str, str], *, dry_run: bool = False) -> str:
    """`kfp: run_metrics=3, tasks=2, ...; argo_archive: skipped (why)` (bounded)."""
    per_target: dict[str, list[str]] = {}
    for target, table, rows in counted.counts:
        per_target.setdefault(target, []).append(f"{table}={rows}")
    parts = [f"{target}: {', '.join(tables)}" for target, tables in per_target.items()]
    if parts and dry_run:
        parts[0] = f"would delete {parts[0]}"
    parts += [f"{target}: skipped ({reason})" for target, reason in skipped.items()]
    return clip("; ".join(parts))


def _chunks(items: list[_Work], size: int) -> Iterator[list[_Work]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
