"""`lapse reconcile`: re-derive schedules from what exists (lapse.operations.reconcile)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import IO

import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from lapse.cli.common import (
    UsageError,
    add_kind,
    add_namespace,
    add_namespace_glob,
    add_selector,
    kinds_of,
    namespace_of,
    reach_nats,
    settings_from,
)
from lapse.cli.output import REPORT_FORMATS, add_output
from lapse.embedded.nats_identities import ADMIN
from lapse.operations.reconcile import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PAGE_SIZE,
    DEFAULT_ROW_PAGE_SIZE,
    Options,
    ReconcileSummary,
    reconcile,
)
from lapse.runtime.resources import Resources

PHASES = {"runs": "finished runs", "rows": "KFP run rows"}
# How often the plain progress lines appear when nobody watches a terminal (CI logs, a
# CronJob): often enough to show life, rarely enough to stay readable.
PLAIN_INTERVAL = 10.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "reconcile",
        help="re-derive schedules from the runs and rows that exist (backfill, safety net)",
        description=(
            "List every finished run of each configured kind (Argo Workflows, Tekton "
            "PipelineRuns and TaskRuns, Jobs, TrainJobs: `kinds` in lapse.yaml; paged) and "
            "plan it exactly as the watcher would; then find KFP run rows whose Workflow "
            "is gone and whose database deadline has passed, and schedule their deletion. "
            "Deadlines already pending are left alone, so running it again is harmless. "
            "Reconcile only schedules: past-due deadlines fire at once and the reapers "
            "pace the deletions (safety.max_deletions_per_second). Run it after installing "
            "lapse on a cluster full of old runs, and periodically as a safety net."
        ),
    )
    add_namespace(parser)
    add_namespace_glob(parser)
    add_selector(parser)
    add_kind(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="only count: read the pending schedules, write nothing",
    )
    parser.add_argument(
        "--only",
        choices=("runs", "rows"),
        help="only the runs pass, or only the KFP rows pass (default: both)",
    )
    parser.add_argument(
        "--page-size",
        type=_positive,
        default=DEFAULT_PAGE_SIZE,
        help="objects per list request (whole objects are listed)",
    )
    parser.add_argument(
        "--row-page-size",
        type=_positive,
        default=DEFAULT_ROW_PAGE_SIZE,
        help="database rows per query",
    )
    parser.add_argument(
        "--concurrency",
        type=_positive,
        default=DEFAULT_CONCURRENCY,
        help="runs planned at the same time",
    )
    add_output(parser, REPORT_FORMATS)
    parser.set_defaults(run=run_reconcile)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def run_reconcile(args: argparse.Namespace) -> int:
    # It schedules deletions: only a cluster chosen explicitly, like `lapse up`.
    config = settings_from(args, ambient_cluster=False, identity=ADMIN).config
    if args.only == "rows" and not config.database.targets.kfp.enabled:
        raise UsageError("--only rows: database.targets.kfp is not enabled")
    if args.only == "rows" and args.selector:
        raise UsageError("-l selects objects; KFP rows whose Workflow is gone carry no labels")
    namespace, pattern = namespace_of(args)
    options = Options(
        # reconcile's filter takes a name or a glob; -n was checked to lie inside the glob
        namespace=namespace or pattern,
        dry_run=args.dry_run,
        runs=args.only in (None, "runs"),
        # With -l only the selected objects are in scope: rows have no labels to select.
        rows=args.only in (None, "rows") and not args.selector,
        page_size=args.page_size,
        row_page_size=args.row_page_size,
        concurrency=args.concurrency,
        label_selector=args.selector,
        kinds=kinds_of(args, config.kinds),
    )

    async def work() -> ReconcileSummary:
        async with Resources(config) as resources:
            await reach_nats(resources)
            with progress_for(sys.stderr) as progress:
                return await reconcile(resources, options, progress)

    summary = asyncio.run(work())
    if args.output == "json":
        json.dump(summary.as_json(), sys.stdout, indent=2)
        print()
    elif args.output == "yaml":
        yaml.safe_dump(summary.as_json(), sys.stdout, sort_keys=False)
    else:
        print_summary(summary, Console(width=200 if not sys.stdout.isatty() else None))
    return 0 if summary.ok else 1


# --- progress -----------------------------------------------------------------------------


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f}/s" if speed else "", style="progress.data.speed")


class BarProgress:
    """A live bar per pass, for a person at a terminal."""

    def __init__(self, stream: IO[str]) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _Rate(),
            TimeElapsedColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> BarProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, phase: str, total: int | None) -> None:
        self._tasks[phase] = self._progress.add_task(PHASES.get(phase, phase), total=total)

    def advance(self, phase: str, count: int) -> None:
        self._progress.advance(self._tasks[phase], count)

    def finish(self, phase: str) -> None:
        task = self._tasks[phase]
        done = self._progress.tasks[task].completed
        # An unknown total becomes the final count, so the finished bar reads full.
        self._progress.update(task, total=done, completed=done)


class LineProgress:
    """One plain line every PLAIN_INTERVAL seconds and one per finished pass, for logs."""

    def __init__(self, stream: IO[str], interval: float = PLAIN_INTERVAL) -> None:
        self._stream = stream
        self._interval = interval
        self._done: dict[str, int] = {}
        self._total: dict[str, int | None] = {}
        self._started: dict[str, float] = {}
        self._last_line = 0.0

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self, phase: str, total: int | None) -> None:
        self._done[phase] = 0
        self._total[phase] = total
        self._started[phase] = self._last_line = time.monotonic()

    def advance(self, phase: str, count: int) -> None:
        self._done[phase] += count
        if time.monotonic() - self._last_line >= self._interval:
            self._line(phase, "")

    def finish(self, phase: str) -> None:
        self._line(phase, " done")

    def _line(self, phase: str, suffix: str) -> None:
        now = time.monotonic()
        self._last_line = now
        done, total = self._done[phase], self._total[phase]
        elapsed = now - self._started[phase]
        of = f"/{total:,}" if total is not None else ""
        rate = f", {done / elapsed:,.0f}/s" if elapsed > 0 else ""
        print(
            f"reconcile: {PHASES.get(phase, phase)}: {done:,}{of} in {elapsed:.1f}s{rate}{suffix}",
            file=self._stream,
            flush=True,
        )


def progress_for(stream: IO[str]) -> BarProgress | LineProgress:
    # Progress goes to stderr, so stdout stays clean for `-o json`: what matters is
    # whether someone watches stderr.
    return BarProgress(stream) if stream.isatty() else LineProgress(stream)


# --- summary ------------------------------------------------------------------------------


def print_summary(summary: ReconcileSummary, console: Console) -> None:
    title = "reconcile (dry run: nothing written)" if summary.dry_run else "reconcile"
    if summary.namespace:
        title += f", namespace {summary.namespace}"
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_column("detail")
    if summary.runs is not None:
        _run_rows(table, summary)
    if summary.rows is not None or summary.rows_skipped is not None:
        _row_rows(table, summary)
    console.print(table)
    for problem in summary.problems:
        console.print(f"[red]problem:[/red] {problem}", highlight=False)


def _run_rows(table: Table, summary: ReconcileSummary) -> None:
    runs = summary.runs
    assert runs is not None
    seconds = summary.seconds.get("runs", 0.0)
    rate = f"in {seconds:.1f}s ({runs.listed / seconds:,.0f}/s)" if seconds > 0 else ""
    deadlines = ", ".join(f"{t} {n:,}" for t, n in sorted(runs.deadlines.items()))
    moved = f"deadlines set or moved: {deadlines}" if deadlines else ""
    lines: list[tuple[str, int, str]] = [
        ("finished Workflows listed", runs.listed, rate),
        ("  scheduled", runs.scheduled, moved),
        ("  unchanged", runs.unchanged, "already pending or already fired"),
        ("  cancelled", runs.cancelled, "kept, or a TTL of never"),
        ("  failed", runs.failed, "refused by the planner: see lapse history --outcome failed"),
        ("  ignored", runs.ignored, "not in a terminal phase"),
    ]
    if runs.errors:
        lines.append(("  errors", runs.errors, "not planned: run reconcile again"))
    _add(table, lines)


def _row_rows(table: Table, summary: ReconcileSummary) -> None:
    if summary.rows_skipped is not None:
        table.add_row("KFP run rows", "-", f"skipped: {summary.rows_skipped}")
        return
    rows = summary.rows
    assert rows is not None
    seconds = summary.seconds.get("rows", 0.0)
    lines: list[tuple[str, int, str]] = [
        ("KFP run rows considered", rows.considered, f"in {seconds:.1f}s" if seconds else ""),
        ("  past due, Workflow gone", rows.orphaned, ""),
        ("    scheduled", rows.scheduled, "database deadline scheduled (fires at once)"),
        ("    unchanged", rows.unchanged, "already pending or already fired"),
        ("  past due, Workflow exists", rows.live, "planned with its Workflow"),
        ("  not due yet", rows.not_due, ""),
        ("  kept forever", rows.never, "database policy: never"),
    ]
    if rows.failed:
        lines.append(("    failed", rows.failed, "see lapse history --outcome failed"))
    if rows.errors:
        lines.append(("    errors", rows.errors, "not scheduled: run reconcile again"))
    if rows.invalid:
        lines.append(("  unreadable", rows.invalid, "not a run lapse can name: left alone"))
    _add(table, lines)


def _add(table: Table, lines: list[tuple[str, int, str]]) -> None:
    for what, count, detail in lines:
        table.add_row(what, f"{count:,}", detail)
