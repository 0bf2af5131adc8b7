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

from lapse.events.builder import build_event, outcome_id, parse_payload
from lapse.events.models import MAX_TEXT, CleanupCompleted, CleanupDue, CleanupFailed, RunFinished
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.schemas import load_schema
from lapse.events.types import EventType, Outcome
from lapse.functions.ports import RetryLater
from lapse.functions.ratelimit import LocalBrake, MassDeletionBrake
from lapse.functions.row_reaper import (
    Contradicted,
    Counted,
    Rejected,
    RowReaper,
    RunResult,
    RunRows,
    TargetSpec,
    Unavailable,
)
from lapse.functions.row_reaper.handler import describe
from lapse.functions.row_reaper.targets import kfp_target
from lapse.functions.row_reaper.verdict import RunFacts, meets
from lapse.functions.safety import SafetyConfig
from tests.fakes import FakeSchedules

DEADLINE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
FINISHED = DEADLINE - timedelta(days=30)
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
    """A RowStore whose answer per run is chosen by the test; `facts` is the database's
    account of every run, judged by the run's precondition as the real store does."""

    def __init__(
        self,
        answer: Callable[[Mapping[str, str]], RunResult] | None = None,
        facts: RunFacts | None = None,
    ) -> None:
        self.answer = answer or (lambda keys: kfp_counts())
        self.facts = facts
        self.calls: list[tuple[list[dict[str, str]], bool]] = []

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return [kfp_target()]

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        self.calls.append(([dict(r.keys) for r in runs], dry_run))
        results: list[RunResult] = []
        for run in runs:
            if self.facts is not None and not self._stands(run, self.facts):
                results.append(Contradicted(self.facts))
            else:
                results.append(self.answer(run.keys))
        return results

    @staticmethod
    def _stands(run: RunRows, facts: RunFacts) -> bool:
        """As the real store judges: whose run first, then the precondition."""
        if facts.namespace is not None and facts.namespace != run.namespace:
            return False
        return run.precondition is None or meets(run.precondition, facts)


class ListEmitter:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def emit(self, event: BaseCloudEvent) -> None:
        self.events.append(event)


def run_ref(run_id: str | None = "r1", uid: str = "uid-1") -> RunRef:
    return RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="team-a",
        name="train-7",
        uid=uid,
        phase="Succeeded",
        labels={KFP_RUN_ID_LABEL: run_id} if run_id else {},
        kfp_run_id=run_id,
        finished_at=FINISHED,
    )


def due(
    run_id: str | None = "r1",
    *,
    target: Target = Target.DATABASE,
    deadline: datetime = DEADLINE,
    uid: str = "uid-1",
) -> BaseCloudEvent:
    payload = CleanupDue(
        run=run_ref(run_id, uid), target=target, deadline=deadline, policy="p",
        scheduled_at=deadline,
    )  # fmt: skip
    return build_event(EventType.CLEANUP_DUE, source="/lapse/test", data=payload)


def reaper(
    rows: FakeRows, *, dry_run: bool = False, **options: Any
) -> tuple[RowReaper, ListEmitter, FakeSchedules]:
    emitter, schedules = ListEmitter(), FakeSchedules()
    handler = RowReaper(
        rows=rows,
        schedules=schedules,
        emitter=emitter,
        safety=SafetyConfig(dry_run=dry_run),
        clock=lambda: NOW,
        **options,
    )
    return handler, emitter, schedules


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
    handler, emitter, stored = reaper(rows)

    event = stored.fired(due("r1"))
    emitted = await handler.handle(event)

    assert emitter.events == emitted
    result = completed(emitted[0])
    assert result.outcome is Outcome.DELETED
    assert result.target is Target.DATABASE
    assert result.detail == "kfp: run_metrics=2, tasks=3, resource_references=2, run_details=1"
    assert result.deadline == DEADLINE
    assert result.latency_seconds == pytest.approx(2.0)
    assert not result.dry_run
    assert emitted[0].get_extension("target") == "database"
    assert emitted[0].get_id() == outcome_id(event.get_id(), EventType.CLEANUP_COMPLETED)
    assert rows.calls == [([{"kfp": "r1"}], False)]


async def test_nothing_deleted_is_already_gone() -> None:
    handler, _, stored = reaper(FakeRows(lambda keys: kfp_counts(0)))

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert result.outcome is Outcome.ALREADY_GONE
    assert result.detail == "kfp: run_metrics=0, tasks=0, resource_references=0, run_details=0"


async def test_dry_run_asks_for_counts_only_and_says_so() -> None:
    rows = FakeRows()
    handler, _, stored = reaper(rows, dry_run=True)

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert rows.calls[0][1] is True
    assert result.outcome is Outcome.DRY_RUN and result.dry_run
    assert result.detail is not None and result.detail.startswith("would delete kfp: ")


async def test_run_without_kfp_run_id_is_already_gone_without_asking_the_database() -> None:
    rows = FakeRows()
    handler, _, stored = reaper(rows)

    result = completed((await handler.handle(stored.fired(due(None))))[0])

    assert rows.calls == []
    assert result.outcome is Outcome.ALREADY_GONE
    assert result.detail == (
        "kfp: skipped (the KFP run id (label pipeline/runid) is not set on team-a/train-7)"
    )


async def test_unusable_input_becomes_cleanup_failed() -> None:
    rows = FakeRows()
    handler, emitter, _ = reaper(rows)
    finished = build_event(
        EventType.RUN_FINISHED, source="/lapse/test", data=RunFinished(run=run_ref())
    )
    broken = due()
    broken_data = dict(broken.get_data())  # type: ignore[arg-type]
    del broken_data["deadline"]
    broken = type(broken)(broken.get_attributes(), broken_data)

    emitted = [*await handler.handle(finished), *await handler.handle(broken)]

    assert rows.calls == []
    assert emitter.events == emitted
    reasons = [failed(e) for e in emitted]
    assert "expected a CleanupDue event" in reasons[0].reason
    assert "deadline" in reasons[1].reason
    assert all(r.stage == "row-reaper" and r.original is not None for r in reasons)
    # One due event, one outcome: the id is derived, so a redelivery is a duplicate.
    assert emitted[1].get_id() == outcome_id(broken.get_id(), EventType.CLEANUP_FAILED)


async def test_kubernetes_due_events_are_not_this_reapers() -> None:
    rows = FakeRows()
    handler, emitter, _ = reaper(rows)

    assert await handler.handle(due(target=Target.KUBERNETES)) == []
    assert rows.calls == [] and emitter.events == []


async def test_unreachable_database_raises_retry_later_after_one_second() -> None:
    handler, emitter, stored = reaper(FakeRows(lambda keys: Unavailable("database unreachable")))

    with pytest.raises(RetryLater) as caught:
        await handler.handle(stored.fired(due()))

    assert caught.value.reason == "database unreachable"
    # The first wait docs/architecture.md states; the runtime doubles it from there.
    assert caught.value.delay == 1.0
    assert emitter.events == []


async def test_refused_run_becomes_cleanup_failed_with_the_run() -> None:
    handler, _, stored = reaper(
        FakeRows(lambda keys: Rejected("the database refused the delete: fk"))
    )

    result = failed((await handler.handle(stored.fired(due("r9"))))[0])

    assert result.reason == "the database refused the delete: fk"
    assert result.run is not None and result.run.kfp_run_id == "r9"
    assert result.target is Target.DATABASE


# --- nothing on anyone's word ----------------------------------------------------------------


async def test_a_due_event_no_stored_schedule_backs_is_refused_and_deletes_nothing() -> None:
    rows = FakeRows()
    handler, emitter, _ = reaper(rows)

    event = due("r1")
    result = completed((await handler.handle(event))[0])

    assert rows.calls == []
    assert result.outcome is Outcome.REFUSED
    assert result.detail is not None and "no schedule lapse stored" in result.detail
    assert emitter.events[0].get_id() == outcome_id(event.get_id(), EventType.CLEANUP_COMPLETED)


async def test_the_stored_deadline_wins_over_the_events() -> None:
    rows = FakeRows()
    handler, _, stored = reaper(rows)
    later = NOW + timedelta(hours=1)
    stored.fired(due("r1", deadline=later))  # what lapse stored: an hour from now

    result = completed((await handler.handle(due("r1", deadline=DEADLINE)))[0])

    assert rows.calls == []
    assert result.outcome is Outcome.RESCHEDULED
    assert result.detail is not None and later.isoformat() in result.detail


async def test_the_stored_runs_keys_are_deleted_never_the_events() -> None:
    rows = FakeRows()
    handler, _, stored = reaper(rows)
    stored.fired(due("r1"))  # lapse stored run r1 under uid-1

    # A forged event: the same uid, another run's KFP id.
    await handler.handle(due("victim", deadline=DEADLINE))

    assert rows.calls == [([{"kfp": "r1"}], False)]


async def test_a_run_the_database_says_is_running_is_kept() -> None:
    running = RunFacts(running=True, finished_at=FINISHED, state="RUNNING")
    handler, _, stored = reaper(FakeRows(facts=running))

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert result.outcome is Outcome.KEPT
    assert result.detail is not None and "not finished (RUNNING)" in result.detail


async def test_a_run_that_finished_later_than_planned_is_rescheduled_by_as_much() -> None:
    later = RunFacts(running=False, finished_at=FINISHED + timedelta(hours=2))
    handler, _, stored = reaper(FakeRows(facts=later))

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert result.outcome is Outcome.RESCHEDULED
    [(target, uid, fire_at, moved)] = stored.puts
    assert (target, uid) == (Target.DATABASE, "uid-1")
    assert fire_at == moved.deadline == DEADLINE + timedelta(hours=2)


async def test_the_brake_reschedules_rows_and_trips_once() -> None:
    brake = MassDeletionBrake(1, 60)
    rows = FakeRows()
    handler, _, stored = reaper(rows, brake=LocalBrake(brake))
    first = await handler.handle(stored.fired(due("r1", uid="u1")))
    second = await handler.handle(stored.fired(due("r2", uid="u2")))
    third = await handler.handle(stored.fired(due("r3", uid="u3")))

    assert completed(first[0]).outcome is Outcome.DELETED
    assert [e.get_type() for e in second] == [EventType.CLEANUP_FAILED, EventType.CLEANUP_COMPLETED]
    assert failed(second[0]).stage == "brake"
    assert completed(second[1]).outcome is Outcome.RESCHEDULED
    assert [completed(e).outcome for e in third] == [Outcome.RESCHEDULED]
    assert rows.calls == [([{"kfp": "r1"}], False)]
    assert [uid for _, uid, _, _ in stored.puts] == ["u2", "u3"]


def test_detail_is_bounded() -> None:
    counted = Counted(tuple(("t", f"table_{i:04d}", i) for i in range(1000)))

    text = describe(counted, {})

    assert len(text) == MAX_TEXT and text.endswith("...")


async def test_rows_another_namespace_records_are_refused_with_the_reason() -> None:
    theirs = RunFacts(running=False, finished_at=FINISHED, namespace="team-b")
    rows = FakeRows(facts=theirs)
    handler, _, stored = reaper(rows)

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert result.outcome is Outcome.REFUSED
    assert result.detail is not None and "namespace 'team-b', not 'team-a'" in result.detail
    assert stored.puts == []


async def test_the_store_is_told_the_stored_runs_namespace() -> None:
    seen: list[str | None] = []

    class Recording(FakeRows):
        async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
            seen.extend(r.namespace for r in runs)
            return await super().delete(runs, dry_run=dry_run)

    handler, _, stored = reaper(Recording())
    await handler.handle(stored.fired(due()))

    assert seen == ["team-a"]


@pytest.mark.parametrize(
    ("namespaces", "why"),
    [
        ({"include": ["team-b", "ci-*"]}, "matches no safety.namespaces.include pattern"),
        ({"exclude": ["team-*"]}, "is excluded by safety.namespaces.exclude 'team-*'"),
    ],
)
async def test_a_run_outside_safety_namespaces_is_skipped_and_the_database_never_asked(
    namespaces: dict[str, Any], why: str
) -> None:
    rows = FakeRows()
    emitter, schedules = ListEmitter(), FakeSchedules()
    safety = SafetyConfig.model_validate({"namespaces": namespaces})
    handler = RowReaper(
        rows=rows, schedules=schedules, emitter=emitter, safety=safety, clock=lambda: NOW
    )

    result = completed((await handler.handle(schedules.fired(due())))[0])

    assert result.outcome is Outcome.SKIPPED
    assert result.detail is not None and why in result.detail
    assert rows.calls == []


async def test_targets_the_store_skipped_are_named_in_the_detail() -> None:
    skipped = Counted(kfp_counts().counts, (("ml_metadata", "not deleted: no KFP run"),))
    handler, _, stored = reaper(FakeRows(lambda keys: skipped))

    result = completed((await handler.handle(stored.fired(due())))[0])

    assert result.outcome is Outcome.DELETED
    assert result.detail is not None
    assert result.detail.endswith("; ml_metadata: skipped (not deleted: no KFP run)")
