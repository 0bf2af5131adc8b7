"""What reconcile reports: its options, its progress, and the counts of each pass."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from cloudevents.core.base import BaseCloudEvent

from lapse.edges.kubernetes import (
    api_failure,
)
from lapse.errors import LapseError
from lapse.events.run import Target
from lapse.events.types import EventType
from lapse.functions.safety import NamespaceFilter

# Whole objects are listed (the planner needs status and spec, which a metadata-only list
# lacks), so pages are kept small: a page is what reconcile holds, twice with the prefetch.
DEFAULT_PAGE_SIZE: Final = 100
DEFAULT_ROW_PAGE_SIZE: Final = 1000
DEFAULT_CONCURRENCY: Final = 64


class ReconcileError(LapseError):
    """Reconcile cannot go on (one line, for the command line)."""


class Progress(Protocol):
    """Where reconcile reports how far it got; `total` is None when unknown up front."""

    def start(self, phase: str, total: int | None) -> None: ...

    def advance(self, phase: str, count: int) -> None: ...

    def finish(self, phase: str) -> None: ...


class NoProgress:
    def start(self, phase: str, total: int | None) -> None:
        pass

    def advance(self, phase: str, count: int) -> None:
        pass

    def finish(self, phase: str) -> None:
        pass


@dataclass(frozen=True)
class Options:
    namespace: str | None = None  # a name or a glob; runs and rows outside it are left alone
    dry_run: bool = False
    runs: bool = True
    rows: bool = True
    page_size: int = DEFAULT_PAGE_SIZE
    row_page_size: int = DEFAULT_ROW_PAGE_SIZE
    concurrency: int = DEFAULT_CONCURRENCY
    label_selector: str | None = None  # only the finished runs it selects (server-side)
    kinds: tuple[str, ...] = ()  # only these configured kinds (by name); empty: every one
    # Only runs of the namespaces this filter admits (the safety net: safety.namespaces).
    within: NamespaceFilter | None = None


@dataclass
class RunCounts:
    """Finished runs: each listed one lands in exactly one of the outcome buckets."""

    listed: int = 0
    scheduled: int = 0  # at least one deadline set or moved
    replaced: int = 0  # of those, at least one deadline that stood was moved
    unchanged: int = 0  # every deadline already pending (or already fired)
    cancelled: int = 0  # a pending deadline withdrawn (keep, never)
    failed: int = 0  # the planner refused the run (e.g. a malformed annotation): dead-lettered
    ignored: int = 0  # not finished, left to its owner, or not readable as its kind
    errors: int = 0  # could not be planned (NATS trouble): try reconcile again
    deadlines: Counter[str] = field(default_factory=Counter)  # set or moved, per target

    def record(self, emitted: Sequence[BaseCloudEvent]) -> None:
        """Count one planned run by what the planner emitted for it."""
        outcome = plan_outcome(emitted)
        if outcome == "failed":
            self.failed += 1
        elif outcome == "scheduled":
            self.scheduled += 1
            self.replaced += int(any_replaced(emitted))
        elif outcome == "cancelled":
            self.cancelled += 1
        else:
            self.unchanged += 1
        self.deadlines.update(scheduled_targets(emitted))

    def as_json(self) -> dict[str, Any]:
        return {
            "listed": self.listed,
            "scheduled": self.scheduled,
            "unchanged": self.unchanged,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "ignored": self.ignored,
            "errors": self.errors,
            "deadlines": {t.value: self.deadlines[t.value] for t in Target},
        }


@dataclass
class RowCounts:
    """Finished KFP runs in the database (FinishedAtInSec set), in the namespace filter."""

    considered: int = 0
    never: int = 0  # the database policy keeps them forever
    not_due: int = 0  # database deadline still ahead: a later reconcile, or the planner
    live: int = 0  # past due but the Workflow exists: the runs pass schedules those
    orphaned: int = 0  # past due and the Workflow is gone: scheduled here
    scheduled: int = 0
    unchanged: int = 0
    failed: int = 0
    errors: int = 0
    invalid: int = 0  # rows that do not make a run reference (not counted as considered)

    def as_json(self) -> dict[str, Any]:
        return {
            "considered": self.considered,
            "never": self.never,
            "notDue": self.not_due,
            "live": self.live,
            "orphaned": self.orphaned,
            "scheduled": self.scheduled,
            "unchanged": self.unchanged,
            "failed": self.failed,
            "errors": self.errors,
            "invalid": self.invalid,
        }


@dataclass
class ReconcileSummary:
    dry_run: bool
    namespace: str | None
    runs: RunCounts | None = None
    rows: RowCounts | None = None
    rows_skipped: str | None = None  # why the rows pass did not run
    seconds: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        errors = (self.runs.errors if self.runs else 0) + (self.rows.errors if self.rows else 0)
        return not self.problems and errors == 0

    def as_json(self) -> dict[str, Any]:
        rows: dict[str, Any] | None = self.rows.as_json() if self.rows else None
        if self.rows_skipped is not None:
            rows = {"skipped": self.rows_skipped}
        return {
            "dryRun": self.dry_run,
            "namespace": self.namespace,
            "runs": self.runs.as_json() if self.runs else None,
            "rows": rows,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "problems": self.problems,
        }


PlanOutcome = Literal["scheduled", "unchanged", "cancelled", "failed"]


def plan_outcome(emitted: Sequence[BaseCloudEvent]) -> PlanOutcome:
    """The one bucket a planned run lands in, from what the planner emitted."""
    types = {event.get_type() for event in emitted}
    if EventType.CLEANUP_FAILED in types:
        return "failed"
    if EventType.CLEANUP_SCHEDULED in types:
        return "scheduled"
    if EventType.CLEANUP_CANCELLED in types:
        return "cancelled"
    return "unchanged"


def any_replaced(emitted: Sequence[BaseCloudEvent]) -> bool:
    """Whether a deadline that stood was moved (a `cleanup.scheduled` with `replaced`)."""
    for event in emitted:
        data = event.get_data()
        if (
            event.get_type() == EventType.CLEANUP_SCHEDULED
            and isinstance(data, dict)
            and data.get("replaced") is True
        ):
            return True
    return False


def scheduled_targets(emitted: Sequence[BaseCloudEvent]) -> list[str]:
    return [
        str(event.get_extension("target"))
        for event in emitted
        if event.get_type() == EventType.CLEANUP_SCHEDULED
    ]


def one_line(exc: BaseException) -> str:
    failure = api_failure(exc)
    if failure is not None:
        status = f"HTTP {failure.status}: " if failure.status else ""
        return f"{status}{failure.message}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
