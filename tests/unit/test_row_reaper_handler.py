"""The row-reaper's decisions, with an in-memory RowStore standing in for the database edge.

The real edge is exercised against PostgreSQL and MariaDB in
tests/integration/test_row_reaper.py; here the question is only what the handler does
with each kind of result and input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema
import pytest
from cloudevents.core.base import BaseCloudEvent

from events.builder import build_event, parse_payload
from events.models import MAX_TEXT, CleanupCompleted, CleanupDue, CleanupFailed, RunFinished
from events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from events.schemas import load_schema
from events.types import EventType, Outcome
from functions.ports import RetryLater
from functions.row_reaper import (
    BatchRetryLater,
    Counted,
    Rejected,
    RowReaper,
    RunResult,
    TargetSpec,
    Unavailable,
)
from functions.row_reaper.handler import describe
from functions.row_reaper.targets import kfp_target

DEADLINE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
NOW = DEADLINE + timedelta(seconds=2)


def kfp_counts(n: int = 1) -> Counted:
    return Counted(
        (
            ("kfp", "run_metrics", 2 * n),
            ("kfp", "tasks", 3 * n),
            ("kfp", "resource_references", 2 * n),
            ("kfp", "run_details", n),
        )
    )


class FakeRows:
    """A RowStore whose answer per run is chosen by the test."""

    def __init__(self, answer: Callable[[Mapping[str, str]], RunResult] | None = None) -> None:
        self.answer = answer or (lambda keys: kfp_counts())
        self.calls: list[tuple[list[dict[str, str]], bool]] = []

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return [kfp_target()]

    async def delete(self, runs: Sequence[Mapping[str, str]], *, dry_run: bool) -> list[RunResult]:
        self.calls.append(([dict(r) for r in runs], dry_run))
        return [self.answer(r) for r in runs]


class ListEmitter:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def emit(self, event: BaseCloudEvent) -> None:
        self.events.append(event)


def run_ref(run_id: str | None = "r1") -> RunRef:
    return RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="team-a",
        name="train-7",
        uid="uid-1",
        phase="Succeeded",
        labels={KFP_RUN_ID_LABEL: run_id} if run_id else {},
        kfp_run_id=run_id,
    )


def due(
    run_id: str | None = "r1", *, target: Target = Target.DATABASE, deadline: datetime = DEADLINE
) -> BaseCloudEvent:
    payload = CleanupDue(
        run=run_ref(run_id), target=target, deadline=deadline, policy="p", scheduled_at=deadline
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/test", data=payload)


def reaper(rows: FakeRows, **options: Any) -> tuple[RowReaper, ListEmitter]:
    emitter = ListEmitter()
    return RowReaper(rows=rows, emitter=emitter, clock=lambda: NOW, **options), emitter


def valid(event: BaseCloudEvent) -> BaseCloudEvent:
    """The event's data validates against the shipped JSON Schema for its type."""
    jsonschema.validate(event.get_data(), load_schema(event.get_type()))
    return event


def completed(event: BaseCloudEvent) -> CleanupCompleted:
    assert valid(event).get_source() == "/lapse/row-reaper"
    return parse_payload(event, CleanupCompleted)


def failed(event: BaseCloudEvent) -> CleanupFailed:
    assert valid(event).get_type() == EventType.CLEANUP_FAILED
    return parse_payload(event, CleanupFailed)


async def test_deleted_rows_are_reported_per_table_with_latency() -> None:
    rows = FakeRows()
    handler, emitter = reaper(rows)

    emitted = await handler.handle(due("r1"))

    assert emitter.events == emitted
    result = completed(emitted[0])
    assert result.outcome is Outcome.DELETED
    assert result.target is Target.DATABASE
    assert result.detail == "kfp: run_metrics=2, tasks=3, resource_references=2, run_details=1"
    assert result.deadline == DEADLINE
    assert result.latency_seconds == pytest.approx(2.0)
    assert not result.dry_run
    assert emitted[0].get_extension("target") == "database"
    assert rows.calls == [([{"kfp": "r1"}], False)]


async def test_nothing_deleted_is_already_gone() -> None:
    handler, _ = reaper(FakeRows(lambda keys: kfp_counts(0)))

    result = completed((await handler.handle(due()))[0])

    assert result.outcome is Outcome.ALREADY_GONE
    assert result.detail == "kfp: run_metrics=0, tasks=0, resource_references=0, run_details=0"


async def test_dry_run_asks_for_counts_only_and_says_so() -> None:
    rows = FakeRows()
    handler, _ = reaper(rows, dry_run=True)

    result = completed((await handler.handle(due()))[0])

    assert rows.calls[0][1] is True
    assert result.outcome is Outcome.DRY_RUN and result.dry_run
    assert result.detail is not None and result.detail.startswith("would delete kfp: ")


async def test_run_without_kfp_run_id_is_already_gone_without_asking_the_database() -> None:
    rows = FakeRows()
    handler, _ = reaper(rows)

    result = completed((await handler.handle(due(None)))[0])

    assert rows.calls == []
    assert result.outcome is Outcome.ALREADY_GONE
    assert result.detail == (
        "kfp: skipped (the KFP run id (label pipeline/runid) is not set on team-a/train-7)"
    )


async def test_unusable_input_becomes_cleanup_failed() -> None:
    rows = FakeRows()
    handler, emitter = reaper(rows)
    finished = build_event(
        EventType.RUN_FINISHED, source="/lapse/test", data=RunFinished(run=run_ref())
    )
    broken = due()
    broken_data = dict(broken.get_data())  # type: ignore[arg-type]
    del broken_data["deadline"]
    broken = type(broken)(broken.get_attributes(), broken_data)

    emitted = await handler.handle_batch([finished, broken])

    assert rows.calls == []
    assert emitter.events == emitted
    reasons = [failed(e) for e in emitted]
    assert "expected a CleanupDue event" in reasons[0].reason
    assert "deadline" in reasons[1].reason
    assert all(r.stage == "row-reaper" and r.original is not None for r in reasons)


async def test_kubernetes_due_events_are_not_this_reapers() -> None:
    rows = FakeRows()
    handler, emitter = reaper(rows)

    assert await handler.handle(due(target=Target.KUBERNETES)) == []
    assert rows.calls == [] and emitter.events == []


async def test_unreachable_database_raises_retry_later_and_emits_nothing() -> None:
    handler, emitter = reaper(
        FakeRows(lambda keys: Unavailable("database unreachable: x")), retry_delay=7
    )

    with pytest.raises(RetryLater) as caught:
        await handler.handle(due())

    assert not isinstance(caught.value, BatchRetryLater)
    assert caught.value.reason == "database unreachable: x"
    assert caught.value.delay == 7
    assert emitter.events == []


async def test_refused_run_becomes_cleanup_failed_with_the_run() -> None:
    handler, _ = reaper(FakeRows(lambda keys: Rejected("the database refused the delete: fk")))

    result = failed((await handler.handle(due("r9")))[0])

    assert result.reason == "the database refused the delete: fk"
    assert result.run is not None and result.run.kfp_run_id == "r9"
    assert result.target is Target.DATABASE


async def test_early_due_event_waits_for_its_deadline() -> None:
    rows = FakeRows()
    handler, emitter = reaper(rows)

    with pytest.raises(RetryLater) as caught:
        await handler.handle(due(deadline=NOW + timedelta(minutes=5)))

    assert caught.value.delay == pytest.approx(300)
    assert rows.calls == [] and emitter.events == []


async def test_slightly_early_due_event_within_clock_skew_is_handled() -> None:
    handler, _ = reaper(FakeRows())

    result = completed((await handler.handle(due(deadline=NOW + timedelta(milliseconds=500))))[0])

    assert result.outcome is Outcome.DELETED


async def test_batch_is_split_into_transactions_of_batch_size() -> None:
    rows = FakeRows()
    handler, emitter = reaper(rows, batch_size=2)

    emitted = await handler.handle_batch([due(f"r{i}") for i in range(5)])

    assert [len(keys) for keys, _ in rows.calls] == [2, 2, 1]
    assert [completed(e).run.kfp_run_id for e in emitted] == [f"r{i}" for i in range(5)]
    assert emitter.events == emitted


async def test_batch_retries_only_the_runs_that_did_not_commit() -> None:
    def answer(keys: Mapping[str, str]) -> RunResult:
        return Unavailable("deadlock") if keys["kfp"] == "r1" else kfp_counts()

    handler, emitter = reaper(FakeRows(answer))
    events = [due(f"r{i}") for i in range(3)]

    with pytest.raises(BatchRetryLater) as caught:
        await handler.handle_batch(events)

    assert [r.event for r in caught.value.retries] == [events[1]]
    assert caught.value.reason == "deadlock"
    assert [completed(e).run.kfp_run_id for e in caught.value.emitted] == ["r0", "r2"]
    assert list(caught.value.emitted) == emitter.events


async def test_batch_stops_asking_a_database_that_failed_a_whole_transaction() -> None:
    rows = FakeRows(lambda keys: Unavailable("database unreachable"))
    handler, emitter = reaper(rows, batch_size=2)
    events = [due(f"r{i}") for i in range(6)]

    with pytest.raises(BatchRetryLater) as caught:
        await handler.handle_batch(events)

    assert len(rows.calls) == 1
    assert [r.event for r in caught.value.retries] == events
    assert emitter.events == []


def test_detail_is_bounded() -> None:
    counted = Counted(tuple(("t", f"table_{i:04d}", i) for i in range(1000)))

    text = describe(counted, {})

    assert len(text) == MAX_TEXT and text.endswith("...")


def test_batch_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        RowReaper(rows=FakeRows(), emitter=ListEmitter(), batch_size=0)
