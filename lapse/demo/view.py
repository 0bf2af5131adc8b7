"""How the tour looks: a live table on a terminal, one line per step elsewhere, a summary."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from lapse.demo.progress import (
    Change,
    DemoSummary,
    RunProgress,
    State,
    TargetProgress,
    Tracker,
    percentile,
)
from lapse.events.run import Target

_STYLES = {
    State.PENDING: "yellow",
    State.DELETED: "green",
    State.KEPT: "cyan",
    State.FAILED: "bold red",
    State.NONE: "dim",
}


def _countdown(progress: TargetProgress, now: datetime) -> str:
    if progress.deadline is None:
        return "waiting for a schedule"
    seconds = (progress.deadline - now).total_seconds()
    return f"due in {seconds:.0f}s" if seconds >= 0.5 else "due now"


def _cell(progress: TargetProgress, now: datetime) -> Text:
    if progress.state is State.PENDING:
        text = f"pending, {_countdown(progress, now)}"
    elif progress.state is State.DELETED and progress.lateness is not None:
        text = f"deleted, {progress.lateness:.2f}s late"
    else:
        text = progress.state.value
    return Text(text, style=_STYLES.get(progress.state, "magenta"))


def _object_source(run: RunProgress) -> str:
    return run.kubernetes.policy or run.sample.hint


def _rows_source(run: RunProgress) -> str:
    if run.sample.rows_ttl is None:
        return "no rows"
    return run.database.policy or f"policy ({run.sample.rows_ttl}s)"


def _artifacts_source(run: RunProgress) -> str:
    if run.sample.artifacts_ttl is None:
        return "no artifacts"
    return run.artifacts.policy or f"policy ({run.sample.artifacts_ttl}s)"


_TARGET_WORDS = {
    Target.KUBERNETES: "object",
    Target.DATABASE: "rows",
    Target.ARTIFACTS: "artifacts",
}


def counts_line(tracker: Tracker) -> str:
    runs = list(tracker.runs.values())
    objects = [r for r in runs if not r.sample.kept]
    rows = [r for r in runs if r.sample.rows_ttl is not None]
    kept = [r for r in runs if r.sample.kept]
    done = sum(r.kubernetes.state is State.DELETED for r in objects)
    rows_done = sum(r.database.state is State.DELETED for r in rows)
    kept_done = sum(r.kubernetes.state is State.KEPT for r in kept)
    return (
        f"objects deleted {done}/{len(objects)}   row sets deleted {rows_done}/{len(rows)}   "
        f"kept {kept_done}/{len(kept)}   failed {len(tracker.failures)}"
    )


def live_table(tracker: Tracker, now: datetime, elapsed: float) -> RenderableType:
    table = Table(
        title=f"lapse demo  t+{elapsed:.0f}s   {counts_line(tracker)}",
        title_justify="left",
        expand=False,
    )
    columns = ("NAME", "PHASE", "OBJECT TTL FROM", "OBJECT", "ROWS TTL FROM", "ROWS")
    artifacts = any(run.sample.artifacts_ttl is not None for run in tracker.runs.values())
    for column in (*columns, *(("ARTIFACTS",) if artifacts else ())):
        table.add_column(column, no_wrap=True)
    for run in tracker.runs.values():
        cells: list[str | Text] = [
            run.sample.name,
            run.sample.phase,
            _object_source(run),
            _cell(run.kubernetes, now),
            _rows_source(run),
            _cell(run.database, now),
        ]
        if artifacts:
            cells.append(_cell(run.artifacts, now))
        table.add_row(*cells)
    legend = Text(
        "OBJECT: the run in the API server.  ROWS: its KFP rows (and, for kfp-footprint, its "
        "ML Metadata) in the database (their own, longer clock)."
        + ("  ARTIFACTS: its outputs in the S3 server (a third clock)." if artifacts else ""),
        style="dim",
    )
    return Group(table, legend)


def change_line(change: Change, elapsed: float) -> str:
    """One plain line per step, for logs and CI."""
    run = change.run
    target = _TARGET_WORDS[change.target]
    progress = run.target(change.target)
    if change.what == "scheduled" and progress.deadline is not None:
        due = (progress.deadline - run.finished_at).total_seconds()
        why = f"{progress.policy}, {due:.0f}s after finishing"
    elif change.what == "deleted" and progress.lateness is not None:
        why = f"{progress.policy or run.sample.hint}, {progress.lateness:.2f}s late"
    elif change.what == "kept" and change.target is Target.KUBERNETES:
        why = f"{run.sample.hint}: TTL ran out, still there"
    else:
        why = progress.detail or run.sample.hint
    return f"  t+{elapsed:5.1f}s  {change.what:<9} {target:<9} {run.sample.name:<16} ({why})"


def print_summary(console: Console, summary: DemoSummary) -> None:
    rows = [
        ("objects deleted", f"{summary.objects_deleted}/{summary.objects_expected}"),
        (
            "by kind",
            ", ".join(f"{k} {c['deleted']}/{c['runs']}" for k, c in summary.kinds.items()),
        ),
        (
            "row sets deleted",
            f"{summary.row_sets_deleted}/{summary.row_sets_expected} ({summary.rows_deleted} rows)",
        ),
        ("kept", f"{summary.kept_present}/{summary.kept_expected} still there"),
        ("failed", str(summary.failed)),
        ("lateness", _lateness_text(summary.all_lateness)),
        (
            "time",
            f"{summary.timing.total:.1f}s (start-up {summary.timing.startup:.1f}s, "
            f"tour {summary.timing.tour:.1f}s)",
        ),
    ]
    table = Table(title="DemoSummary", title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)
    if summary.footprint is not None:
        print_footprint(console, summary.footprint)
    if summary.ok:
        console.print("[green]Everything expected happened.[/green]")
        return
    console.print("[bold red]Not as expected:[/bold red]")
    for problem in summary.problems:
        console.print(f"  - {problem}", markup=False, highlight=False)


def footprint_lines(footprint: dict[str, Any]) -> list[str]:
    """Each part of the footprint run: its clock, what happened, and what the final check
    read in the database and the S3 server."""
    metadata, artifacts = footprint["metadata"], footprint["s3"]

    def part(name: str, what: str, checked: str) -> str:
        p = footprint[name]
        seconds = p["dueSeconds"]
        due = "no deadline" if seconds is None else f"due {seconds:.0f}s after finishing"
        late = "" if p["latenessSeconds"] is None else f", {p['latenessSeconds']:.2f}s late"
        return f"  {what:<34} {due:<28} {p['state']}{late}; {checked}"

    lines = [f"footprint of {footprint['run']} (one KFP run, each part on its own clock):"]
    lines.append(part("object", "Workflow (kubernetes clock)", "checked in the API server"))
    lines.append(
        part(
            "rows",
            "KFP rows + ML Metadata (database)",
            f"{metadata['left']}/{metadata['rows']} metadata rows left, pipeline context "
            + ("kept" if metadata["pipelineContextKept"] else "GONE"),
        )
    )
    if artifacts["objects"]:
        lines.append(
            part(
                "artifacts",
                "artifacts in S3 (artifacts clock)",
                f"{artifacts['left']}/{artifacts['objects']} objects left, "
                f"{artifacts['besideLeft']}/{artifacts['beside']} beside the prefix kept",
            )
        )
    if footprint.get("note"):
        lines.append(f"  note: {footprint['note']}")
    return lines


def print_footprint(console: Console, footprint: dict[str, Any]) -> None:
    for line in footprint_lines(footprint):
        console.print(line, markup=False, highlight=False)


def _lateness_text(values: list[float]) -> str:
    if not values:
        return "no deletions"
    p50, p99 = percentile(values, 0.50), percentile(values, 0.99)
    return (
        f"p50 {p50:.3f}s  p99 {p99:.3f}s  max {max(values):.3f}s over {len(values)} "
        "deletions (done - deadline)"
    )


@dataclass
class Output:
    """Where progress goes: a live table, or plain lines (on stderr when stdout is JSON)."""

    console: Console
    live: bool
    started: float = 0.0  # monotonic time the first workflow was created

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0

    def note(self, text: str) -> None:
        if self.live:
            self.console.print(f"[dim]{text}[/dim]", highlight=False)
        else:
            self.console.print(text, markup=False, highlight=False)

    def trace(self, name: str, tree: str) -> None:
        """One run's trace tree (on stderr with -o json, so stdout stays JSON)."""
        self.console.print(f"\ntrace of {name} (planner -> schedule -> reapers):", markup=False)
        self.console.print(tree, markup=False, highlight=False)
