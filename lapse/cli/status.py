"""`lapse status`: what lapse is waiting to do, and what it did recently."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from events.run import Target
from events.timeutil import format_rfc3339
from lapse.cli.common import add_nats_url, config_from
from lapse.config import LapseConfig
from lapse.operations.audit import OUTCOME_TYPES, audit_events, history_row, pending_schedules
from lapse.runtime.resources import Resources


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = subparsers.add_parser(
        "status",
        help="pending schedules, next deadlines, dead letters, recent outcomes",
        description="Summarize what lapse is waiting to do and what it did recently.",
    )
    status.add_argument("--recent", type=int, default=10, help="recent outcomes to show")
    status.add_argument("-o", "--output", choices=("table", "json"), default="table")
    add_nats_url(status)
    status.set_defaults(run=run_status)


async def status_report(config: LapseConfig, args: argparse.Namespace) -> dict[str, Any]:
    async with Resources(config, nats_url=args.nats_url) as resources:
        js = await resources.jetstream()
        streams = config.nats.streams
        pending = [await pending_schedules(js, streams.schedule, t) for t in Target]
        dlq = await js.stream_info(streams.dlq)
        audit = await js.stream_info(streams.audit)
        start = max(1, audit.state.last_seq - 50 * args.recent)
        recent = [
            row
            async for event in audit_events(js, streams.audit, start_seq=start)
            if event.get_type() in OUTCOME_TYPES and (row := history_row(event)) is not None
        ][-args.recent :]
    return {
        "pending": {
            p.target.value: {
                "count": p.count,
                "next": [{"deadline": format_rfc3339(d), "run": r} for d, r in p.next_deadlines],
                "scanned": p.scanned,
            }
            for p in pending
        },
        "deadLetters": dlq.state.messages,
        "recent": recent,
    }


def run_status(args: argparse.Namespace) -> int:
    config = config_from(args)
    report = asyncio.run(status_report(config, args))
    if args.output == "json":
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    console = Console(width=200 if not sys.stdout.isatty() else None)
    for target, summary in report["pending"].items():
        nxt = ", ".join(f"{n['run']} at {n['deadline']}" for n in summary["next"]) or "-"
        console.print(f"pending {target}: {summary['count']}   next: {nxt}")
    console.print(f"dead letters: {report['deadLetters']}")
    table = Table(title="recent outcomes", title_justify="left")
    for column in ("time", "namespace", "name", "target", "outcome", "detail"):
        table.add_column(column.upper(), overflow="fold")
    for row in report["recent"]:
        table.add_row(
            *(
                str(row[c] or "")
                for c in ("time", "namespace", "name", "target", "outcome", "detail")
            )
        )
    console.print(table)
    return 0
