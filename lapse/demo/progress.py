"""What happened to each sample run, read from lapse's audit events, and the final verdict.

The audit stream says what lapse decided and did; the API server and the database say what
is really there. The tour shows the first as it happens and judges by both at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from cloudevents.core.base import BaseCloudEvent

from lapse.demo.scenario import Sample
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupCancelled, CleanupCompleted, CleanupFailed, CleanupScheduled
from lapse.events.run import Target
from lapse.events.types import Outcome


class State(StrEnum):
    PENDING = "pending"
    DELETED = "deleted"
    KEPT = "kept"
    FAILED = "failed"
    GONE = "already gone"
    REPLACED = "replaced"
    DRY_RUN = "dry run"
    NONE = "-"  # nothing to clean up for this target (a run without database rows)


_OUTCOME_STATES = {
    Outcome.DELETED: State.DELETED,
    Outcome.ALREADY_GONE: State.GONE,
    Outcome.KEPT: State.KEPT,
    Outcome.REPLACED: State.REPLACED,
    Outcome.DRY_RUN: State.DRY_RUN,
    Outcome.RESCHEDULED: State.PENDING,
}


@dataclass
class TargetProgress:
    state: State
    policy: str | None = None  # what set the deadline, as lapse reports it
    deadline: datetime | None = None
    lateness: float | None = None  # seconds after the deadline it was done
    detail: str | None = None


@dataclass
class RunProgress:
    sample: Sample
    finished_at: datetime
    kubernetes: TargetProgress = field(default_factory=lambda: TargetProgress(State.PENDING))
    database: TargetProgress = field(default_factory=lambda: TargetProgress(State.NONE))
    artifacts: TargetProgress = field(default_factory=lambda: TargetProgress(State.NONE))

    def target(self, target: Target) -> TargetProgress:
        if target is Target.KUBERNETES:
            return self.kubernetes
        return self.artifacts if target is Target.ARTIFACTS else self.database

    @property
    def object_due(self) -> datetime:
        """When the object's TTL runs out (for a kept run: the TTL keep overrides)."""
        return self.finished_at + timedelta(seconds=self.sample.object_ttl)


@dataclass(frozen=True)
class Change:
    """One step worth telling: a schedule, an outcome, a failure, a kept run confirmed."""

    run: RunProgress
    target: Target
    what: str


class Tracker:
    def __init__(self, samples: Sequence[Sample], finished_at: datetime) -> None:
        # Kubernetes timestamps have whole seconds: deadlines count from the truncated time.
        self.finished_at = finished_at.replace(microsecond=0)
        self.runs = {s.name: RunProgress(s, self.finished_at) for s in samples}
        for run in self.runs.values():
            if run.sample.rows_ttl is not None:
                run.database.state = State.PENDING
            if run.sample.artifacts_ttl is not None:
                run.artifacts.state = State.PENDING
        self.failures: list[str] = []

    def apply(self, event: BaseCloudEvent) -> Change | None:
        try:
            payload = parse_payload(event)
        except InvalidEvent:
            return None
        if isinstance(payload, CleanupFailed):
            return self._failed(payload)
        if not isinstance(payload, CleanupScheduled | CleanupCompleted | CleanupCancelled):
            return None
        run = self.runs.get(payload.run.name)
        if run is None:
            return None
        if payload.target is Target.ARTIFACTS and run.sample.artifacts_ttl is None:
            return None  # planned on the database clock, with nothing captured: not shown
        progress = run.target(payload.target)
        if isinstance(payload, CleanupScheduled):
            progress.policy, progress.deadline = payload.policy, payload.deadline
            return Change(run, payload.target, "scheduled")
        if isinstance(payload, CleanupCancelled):
            progress.detail = payload.reason
            return Change(run, payload.target, "cancelled")
        return self._completed(run, payload)

    def _completed(self, run: RunProgress, payload: CleanupCompleted) -> Change | None:
        progress = run.target(payload.target)
        # Delivery is at-least-once: a repeat reports already_gone for what is deleted.
        if progress.state is State.DELETED:
            return None
        progress.state = _OUTCOME_STATES[payload.outcome]
        progress.detail = payload.detail
        if payload.deadline is not None:
            progress.deadline = payload.deadline
        if payload.outcome is Outcome.DELETED:
            progress.lateness = payload.latency_seconds
        return Change(run, payload.target, progress.state.value)

    def _failed(self, payload: CleanupFailed) -> Change | None:
        run = self.runs.get(payload.run.name) if payload.run else None
        who = f"{payload.target or 'cleanup'} of {payload.run.name}" if payload.run else "input"
        self.failures.append(f"{who} failed ({payload.stage}): {payload.reason}")
        if run is None or payload.target is None:
            return None
        if payload.target is Target.ARTIFACTS and run.sample.artifacts_ttl is None:
            return None
        progress = run.target(payload.target)
        progress.state, progress.detail = State.FAILED, payload.reason
        return Change(run, payload.target, "failed")

    def observe(self, present: set[str], now: datetime) -> list[Change]:
        """What the API server shows: a kept run counts as kept once the TTL its keep
        annotation overrides has run out and the object is still there."""
        changes = []
        for run in self.runs.values():
            if not run.sample.kept or run.kubernetes.state is not State.PENDING:
                continue
            if run.sample.name in present and now >= run.object_due:
                run.kubernetes.state = State.KEPT
                changes.append(Change(run, Target.KUBERNETES, "kept"))
        return changes

    @property
    def settled(self) -> bool:
        return all(
            State.PENDING not in (run.kubernetes.state, run.database.state, run.artifacts.state)
            for run in self.runs.values()
        )


# --- the verdict ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FootprintLeft:
    """The footprint run's parts at the end, read from the database and the S3 server."""

    run: str  # the sample's name
    metadata_rows: int  # its ML Metadata rows written before the tour
    metadata_left: Mapping[str, int]  # MLMD table -> the run's rows still there
    pipeline_context_kept: bool  # the pipeline's context (every run's) is still there
    artifacts: int  # objects planted under the run's prefix (0: no S3 server)
    artifacts_left: tuple[str, ...]  # of those, the keys still there
    beside: int  # objects planted beside the prefix (another run's, a sibling prefix)
    beside_left: int  # of those, how many are still there (all of them, or it went wrong)
    note: str | None = None  # a part the demo could not show, and why

    def as_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "metadata": {
                "rows": self.metadata_rows,
                "left": sum(self.metadata_left.values()),
                "pipelineContextKept": self.pipeline_context_kept,
            },
            "s3": {
                "objects": self.artifacts,
                "left": len(self.artifacts_left),
                "beside": self.beside,
                "besideLeft": self.beside_left,
            },
            "note": self.note,
        }


@dataclass(frozen=True)
class Leftovers:
    """What the API server, the database and the S3 server hold at the end."""

    objects: frozenset[str]  # workflow names still present
    rows: Mapping[str, int]  # KFP run id -> rows still present
    footprint: FootprintLeft | None = None


@dataclass(frozen=True)
class Timing:
    startup: float  # servers, tables and the pipeline, until the first workflow
    tour: float  # first workflow created until everything settled (or the wait ran out)

    @property
    def total(self) -> float:
        return self.startup + self.tour


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile: always one of the observed values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _lateness(values: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50": percentile(values, 0.50),
        "p99": percentile(values, 0.99),
        "max": max(values) if values else None,
    }


@dataclass(frozen=True)
class DemoSummary:
    runs: int
    objects_expected: int
    objects_deleted: int
    row_sets_expected: int
    row_sets_deleted: int
    rows_deleted: int
    kept_expected: int
    kept_present: int
    failed: int
    lateness: dict[str, list[float]]  # per target, seconds, deleted outcomes only
    timing: Timing
    problems: tuple[str, ...]
    # Runs per Kubernetes kind (Workflow, PipelineRun, Job), and how many of each went.
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    # The footprint run: each part's state, deadline (s after finishing) and lateness, and
    # what the database and the S3 server still hold of it.
    footprint: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def all_lateness(self) -> list[float]:
        return [value for values in self.lateness.values() for value in values]

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "workflows": self.runs,
            "kinds": self.kinds,
            "objects": {"expected": self.objects_expected, "deleted": self.objects_deleted},
            "rowSets": {
                "expected": self.row_sets_expected,
                "deleted": self.row_sets_deleted,
                "rows": self.rows_deleted,
            },
            "kept": {"expected": self.kept_expected, "present": self.kept_present},
            "failed": self.failed,
            "latenessSeconds": {
                **_lateness(self.all_lateness),
                "byTarget": {target: _lateness(v) for target, v in self.lateness.items()},
            },
            "seconds": {
                "startup": round(self.timing.startup, 2),
                "tour": round(self.timing.tour, 2),
                "total": round(self.timing.total, 2),
            },
            "footprint": self.footprint,
            "problems": list(self.problems),
        }


def summarize(
    tracker: Tracker, leftovers: Leftovers, timing: Timing, rows_per_run: int
) -> DemoSummary:
    runs = list(tracker.runs.values())
    deletable = [r for r in runs if not r.sample.kept]
    with_rows = [r for r in runs if r.sample.kfp_run_id is not None]
    kept = [r for r in runs if r.sample.kept]
    objects_deleted = [
        r for r in deletable
        if r.kubernetes.state is State.DELETED and r.sample.name not in leftovers.objects
    ]  # fmt: skip
    rows_deleted = [
        r for r in with_rows
        if r.database.state is State.DELETED and not leftovers.rows.get(_run_id(r), 0)
    ]  # fmt: skip
    lateness = {
        target.value: [
            p.lateness
            for r in runs
            if (p := r.target(target)).state is State.DELETED and p.lateness is not None
        ]
        for target in (Target.KUBERNETES, Target.DATABASE, Target.ARTIFACTS)
    }
    return DemoSummary(
        runs=len(runs),
        objects_expected=len(deletable),
        objects_deleted=len(objects_deleted),
        row_sets_expected=len(with_rows),
        row_sets_deleted=len(rows_deleted),
        rows_deleted=len(rows_deleted) * rows_per_run,
        kept_expected=len(kept),
        kept_present=sum(r.sample.name in leftovers.objects for r in kept),
        failed=len(tracker.failures),
        lateness=lateness,
        timing=timing,
        problems=tuple(problems(runs, leftovers, tracker.failures)),
        kinds=_by_kind(runs, objects_deleted),
        footprint=_footprint(tracker, leftovers.footprint),
    )


def _footprint(tracker: Tracker, left: FootprintLeft | None) -> dict[str, Any] | None:
    if left is None or left.run not in tracker.runs:
        return None
    run = tracker.runs[left.run]

    def part(progress: TargetProgress) -> dict[str, Any]:
        due = progress.deadline
        return {
            "state": progress.state.value,
            "dueSeconds": None if due is None else (due - run.finished_at).total_seconds(),
            "latenessSeconds": progress.lateness,
        }

    return {
        "object": part(run.kubernetes),
        "rows": part(run.database),
        "artifacts": part(run.artifacts),
        **left.as_json(),
    }


def _by_kind(runs: list[RunProgress], deleted: list[RunProgress]) -> dict[str, dict[str, int]]:
    kinds: dict[str, dict[str, int]] = {}
    for run in runs:
        counts = kinds.setdefault(run.sample.run_kind.kind, {"runs": 0, "deleted": 0})
        counts["runs"] += 1
        counts["deleted"] += run in deleted
    return kinds


def _run_id(run: RunProgress) -> str:
    return run.sample.kfp_run_id or ""


def problems(
    runs: Iterable[RunProgress], leftovers: Leftovers, failures: Sequence[str]
) -> list[str]:
    """Everything that did not go as the tour expects, one sentence each."""
    found = list(failures)
    for run in runs:
        name, k8s, db = run.sample.name, run.kubernetes, run.database
        if run.sample.kept and name not in leftovers.objects:
            found.append(f"workflow {name} carries lapse.dev/keep but was deleted")
        elif not run.sample.kept and name in leftovers.objects:
            found.append(f"workflow {name} was not deleted ({_state(k8s)})")
        elif not run.sample.kept and k8s.state is not State.DELETED:
            found.append(f"workflow {name} is gone but lapse reported {_state(k8s)}")
        left = leftovers.rows.get(_run_id(run), 0)
        if left:
            found.append(f"{left} KFP row(s) of {name} are still in the database ({_state(db)})")
        if run.sample.artifacts_ttl is not None and run.artifacts.state is not State.DELETED:
            found.append(f"the artifacts of {name} were not deleted ({_state(run.artifacts)})")
        for target in (Target.KUBERNETES, Target.DATABASE, Target.ARTIFACTS):
            progress = run.target(target)
            if progress.lateness is not None and progress.lateness < 0:
                found.append(
                    f"{target} cleanup of {name} ran {-progress.lateness:.2f}s before its deadline"
                )
    if leftovers.footprint is not None:
        found += footprint_problems(leftovers.footprint)
    return found


def footprint_problems(left: FootprintLeft) -> list[str]:
    found = []
    if left.metadata_left:
        tables = ", ".join(f"{t} {n}" for t, n in sorted(left.metadata_left.items()))
        found.append(f"ML Metadata rows of {left.run} are still in the database ({tables})")
    if not left.pipeline_context_kept:
        found.append(f"the pipeline's ML Metadata context went with {left.run} (it is shared)")
    if left.artifacts_left:
        found.append(
            f"{len(left.artifacts_left)} artifact(s) of {left.run} are still in the S3 server: "
            + ", ".join(left.artifacts_left[:3])
        )
    if left.beside_left < left.beside:
        found.append(
            f"{left.beside - left.beside_left} object(s) beside {left.run}'s prefix were "
            "deleted: lapse reached outside the run's artifacts"
        )
    return found


def _state(progress: TargetProgress) -> str:
    detail, state = progress.detail, progress.state.value
    if not detail or progress.state is State.DELETED:
        return state
    return detail if detail.startswith(state) else f"{state}: {detail}"
