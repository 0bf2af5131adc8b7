"""`lapse plan`: a read-only preview of what lapse would delete, when, and by which rule."""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from events.adapters import adapt_workflow
from events.errors import InvalidEvent
from events.models import RunFinished
from events.run import RunRef, Target
from events.timeutil import format_rfc3339
from functions.policy import Action, Decision, Policy, plan
from lapse.cli.common import config_from
from lapse.edges.kubernetes import Workflows, finished_workflow_pages
from lapse.runtime.resources import Resources

PAGE_SIZE = 500


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="preview deadlines of finished runs (read-only)",
        description=(
            "List the finished Argo Workflows in the cluster and, for each target (the "
            "Kubernetes object and the database rows), the deadline lapse would set and the "
            "rule that set it. Reads only; changes nothing."
        ),
    )
    parser.add_argument("-n", "--namespace", help="only this namespace (glob allowed)")
    parser.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="table (default) or json"
    )
    parser.set_defaults(run=run_plan)


@dataclass(frozen=True)
class PlannedRun:
    run: RunRef
    decisions: dict[Target, Decision]

    def as_json(self) -> dict[str, Any]:
        return {
            "namespace": self.run.namespace,
            "name": self.run.name,
            "uid": self.run.uid,
            "phase": self.run.phase,
            "finishedAt": format_rfc3339(self.run.finished_at) if self.run.finished_at else None,
            "kfpRunId": self.run.kfp_run_id,
            "targets": {
                target.value: {
                    "action": d.action.value,
                    "deadline": format_rfc3339(d.deadline) if d.deadline else None,
                    "policy": d.policy,
                    "reason": d.reason,
                }
                for target, d in self.decisions.items()
            },
        }


async def finished_runs(
    workflows: Workflows, namespace_glob: str | None = None
) -> AsyncIterator[RunRef]:
    """Every finished Workflow, page by page, so memory stays flat on large clusters."""
    async for page in finished_workflow_pages(workflows, page_size=PAGE_SIZE):
        for obj in page.items:
            try:
                result = adapt_workflow(obj)
            except InvalidEvent:
                continue
            if not isinstance(result, RunFinished):
                continue
            if namespace_glob and not fnmatch.fnmatchcase(result.run.namespace, namespace_glob):
                continue
            yield result.run


async def planned_runs(
    resources: Resources, policies: tuple[Policy, ...], namespace_glob: str | None, now: datetime
) -> list[PlannedRun]:
    return [
        PlannedRun(run, plan(run, policies, now))
        async for run in finished_runs(resources.workflows(), namespace_glob)
    ]


def run_plan(args: argparse.Namespace) -> int:
    config = config_from(args)
    now = datetime.now(UTC)

    async def collect() -> list[PlannedRun]:
        async with Resources(config) as resources:
            return await planned_runs(resources, tuple(config.policies), args.namespace, now)

    rows = asyncio.run(collect())
    if args.output == "json":
        json.dump([row.as_json() for row in rows], sys.stdout, indent=2)
        print()
    else:
        print_table(rows, now)
    return 0


def _describe(decision: Decision, now: datetime) -> str:
    if decision.action is Action.CANCEL:
        return "never"
    if decision.action is Action.INVALID:
        return "invalid"
    assert decision.deadline is not None
    seconds = (decision.deadline - now).total_seconds()
    when = "due now" if seconds <= 0 else f"in {_human(seconds)}"
    return f"{format_rfc3339(decision.deadline)} ({when})"


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def print_table(rows: list[PlannedRun], now: datetime) -> None:
    table = Table(title=f"{len(rows)} finished run(s)", title_justify="left")
    for column in ("NAMESPACE", "NAME", "PHASE", "KUBERNETES", "BY", "DATABASE", "BY"):
        table.add_column(column, overflow="fold")
    for row in rows:
        k8s, db = row.decisions[Target.KUBERNETES], row.decisions[Target.DATABASE]
        table.add_row(
            row.run.namespace,
            row.run.name,
            row.run.phase,
            _describe(k8s, now),
            k8s.policy,
            _describe(db, now),
            db.policy,
        )
    Console(width=200 if not sys.stdout.isatty() else None).print(table)
