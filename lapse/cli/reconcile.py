"""`lapse reconcile`: re-derive schedules from what exists (lapse.operations.reconcile)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import IO, TYPE_CHECKING

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
from lapse.cli.output import REPORT_FORMATS, add_output, aligned, document, templated
from lapse.embedded.nats_identities import ADMIN

if TYPE_CHECKING:
    from lapse.operations.reconcile import ReconcileSummary

# lapse.operations.reconcile's defaults (tests/unit/test_cli_names.py keeps them equal).
DEFAULT_PAGE_SIZE = 100
DEFAULT_ROW_PAGE_SIZE = 1000
DEFAULT_CONCURRENCY = 64


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
    from lapse.cli.progress import progress_for
    from lapse.operations.reconcile import Options, reconcile
    from lapse.runtime.resources import Resources

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
    if args.output in ("json", "yaml"):
        document(summary.as_json(), args, sys.stdout)
    elif not templated(args.output, summary.as_json(), args, sys.stdout):
        print_summary(summary, sys.stdout)
    return 0 if summary.ok else 1


# --- summary ------------------------------------------------------------------------------


Line = tuple[str, str, str]


def print_summary(summary: ReconcileSummary, out: IO[str]) -> None:
    """A title, then plain aligned columns (what, count, detail), then each problem."""
    title = "reconcile (dry run: nothing written)" if summary.dry_run else "reconcile"
    if summary.namespace:
        title += f", namespace {summary.namespace}"
    lines: list[Line] = []
    if summary.runs is not None:
        lines += _run_rows(summary)
    if summary.rows is not None or summary.rows_skipped is not None:
        lines += _row_rows(summary)
    out.write(title + "\n")
    width = max((len(count) for _, count, _ in lines), default=0)
    for line in aligned([[what, count.rjust(width), detail] for what, count, detail in lines]):
        out.write(line + "\n")
    for problem in summary.problems:
        out.write(f"problem: {problem}\n")


def _run_rows(summary: ReconcileSummary) -> list[Line]:
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
    return _counted(lines)


def _row_rows(summary: ReconcileSummary) -> list[Line]:
    if summary.rows_skipped is not None:
        return [("KFP run rows", "-", f"skipped: {summary.rows_skipped}")]
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
    return _counted(lines)


def _counted(lines: list[tuple[str, int, str]]) -> list[Line]:
    return [(what, f"{count:,}", detail) for what, count, detail in lines]
