"""`lapse history`: the audit trail, what lapse did and why."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from events.run import Target
from functions.durations import parse_duration
from lapse.cli.common import UsageError, add_nats_url, config_from
from lapse.config import LapseConfig
from lapse.operations.audit import OUTCOME_TYPES, audit_events, history_row
from lapse.runtime.resources import Resources


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    history = subparsers.add_parser(
        "history",
        help="the audit trail: what was deleted, when, why",
        description=(
            "Print the audit trail from the audit stream: every cleanup outcome (deleted, "
            "already gone, kept, skipped, rescheduled, dry run, failed) with its deadline, "
            "lateness and reason. Use --all to include schedules and cancellations."
        ),
    )
    history.add_argument("-n", "--namespace", help="only runs in this namespace")
    history.add_argument("--name", help="only runs with this name")
    history.add_argument("--target", choices=[t.value for t in Target])
    history.add_argument("--outcome", help="only this outcome (deleted, kept, failed, ...)")
    history.add_argument("--since", help="only the last DURATION (e.g. 1h, 7d)")
    history.add_argument("--all", action="store_true", help="also scheduled/cancelled events")
    history.add_argument("-o", "--output", choices=("table", "json"), default="table")
    add_nats_url(history)
    history.set_defaults(run=run_history)


def _keep(row: dict[str, Any], args: argparse.Namespace) -> bool:
    wanted = {
        "namespace": args.namespace,
        "name": args.name,
        "target": args.target,
        "outcome": args.outcome,
    }
    return all(value is None or row.get(key) == value for key, value in wanted.items())


async def history_rows(config: LapseConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    since = None
    if args.since:
        try:
            since = datetime.now(UTC) - parse_duration(args.since, what="--since")
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    rows = []
    async with Resources(config, nats_url=args.nats_url) as resources:
        js = await resources.jetstream()
        async for event in audit_events(js, config.nats.streams.audit, since=since):
            if not args.all and event.get_type() not in OUTCOME_TYPES:
                continue
            row = history_row(event)
            if row is not None and _keep(row, args):
                rows.append(row)
    return rows


def run_history(args: argparse.Namespace) -> int:
    config = config_from(args)
    rows = asyncio.run(history_rows(config, args))
    if args.output == "json":
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    table = Table(title=f"{len(rows)} event(s)", title_justify="left")
    columns = ("time", "namespace", "name", "target", "outcome", "latencySeconds", "detail")
    for column in columns:
        table.add_column(column.upper().replace("SECONDS", " (s)"), overflow="fold")
    for row in rows:
        latency = row["latencySeconds"]
        cells = {**row, "latencySeconds": f"{latency:.2f}" if latency is not None else ""}
        table.add_row(*(str(cells[c] or "") for c in columns))
    Console(width=200 if not sys.stdout.isatty() else None).print(table)
    return 0
