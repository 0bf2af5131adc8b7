"""`lapse history` and `lapse status`: what lapse did, and what it is waiting to do."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from rich.console import Console
from rich.table import Table

from events.builder import parse_payload
from events.errors import InvalidEvent
from events.models import CleanupCompleted, CleanupFailed
from events.run import Target
from events.timeutil import format_rfc3339
from events.types import EventType
from functions.durations import parse_duration
from lapse.cli.common import UsageError, config_from
from lapse.config import LapseConfig
from lapse.operations.audit import audit_events, pending_schedules
from lapse.runtime.resources import Resources

OUTCOME_TYPES = (EventType.CLEANUP_COMPLETED, EventType.CLEANUP_FAILED)


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
    _nats_url(history)
    history.set_defaults(run=run_history)

    status = subparsers.add_parser(
        "status",
        help="pending schedules, next deadlines, dead letters, recent outcomes",
        description="Summarize what lapse is waiting to do and what it did recently.",
    )
    status.add_argument("--recent", type=int, default=10, help="recent outcomes to show")
    status.add_argument("-o", "--output", choices=("table", "json"), default="table")
    _nats_url(status)
    status.set_defaults(run=run_status)


def _nats_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="NATS server (default: nats.url from the config)")


def history_row(event: BaseCloudEvent) -> dict[str, Any] | None:
    try:
        payload = parse_payload(event)
    except InvalidEvent:
        return None
    run = getattr(payload, "run", None)
    time = event.get_time()
    row: dict[str, Any] = {
        "time": format_rfc3339(time) if time else None,
        "event": str(event.get_type()).removeprefix("dev.lapse.").removesuffix(".v1"),
        "namespace": run.namespace if run else None,
        "name": run.name if run else None,
        "uid": run.uid if run else None,
        "target": getattr(payload, "target", None),
        "outcome": None,
        "deadline": None,
        "latencySeconds": None,
        "detail": None,
        "source": event.get_source(),
    }
    if isinstance(payload, CleanupCompleted):
        row["outcome"] = payload.outcome.value
        row["deadline"] = format_rfc3339(payload.deadline) if payload.deadline else None
        row["latencySeconds"] = payload.latency_seconds
        row["detail"] = payload.detail
    elif isinstance(payload, CleanupFailed):
        row["outcome"] = "failed"
        row["detail"] = payload.reason
    else:
        deadline = getattr(payload, "deadline", None)
        row["deadline"] = format_rfc3339(deadline) if deadline else None
        row["detail"] = getattr(payload, "policy", None) or getattr(payload, "reason", None)
    if row["target"] is not None:
        row["target"] = str(row["target"])
    return row


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
