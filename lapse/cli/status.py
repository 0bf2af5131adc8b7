"""`lapse status`: what lapse is waiting to do, and what it did recently."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

from lapse.cli.common import Settings, reach_nats, read_waiting_out_nats, settings_from
from lapse.cli.history import COLUMNS as HISTORY_COLUMNS
from lapse.cli.history import Filters, add_filters, audit_row
from lapse.cli.output import REPORT_FORMATS, add_output, document, table, templated
from lapse.cli.watch import add_watch, run_watch, watch

if TYPE_CHECKING:
    from lapse.runtime.resources import Resources

RECENT_COLUMNS = [c for c in HISTORY_COLUMNS if c.header != "LATE (S)"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = subparsers.add_parser(
        "status",
        help="pending schedules, next deadlines, dead letters, recent outcomes",
        description=(
            "Summarize what lapse is waiting to do and what it did recently, and say which "
            "NATS server (and database) it read: the configured one, or the one `lapse up` "
            "started (its state directory)."
        ),
    )
    status.add_argument(
        "--recent", type=int, default=10, metavar="N", help="how many recent outcomes to show"
    )
    # kubectl's habit: `-A` is accepted; status always covers every namespace.
    status.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="every namespace (what status always shows; accepted as in kubectl)",
    )
    add_filters(status)
    status.add_argument(
        "--fleet",
        action="store_true",
        help="each cluster of the fleet as its hub knows it (fleet.hub): when it last heard "
        "from the cluster, how far behind it is, its audit events (docs/fleet.md)",
    )
    add_output(status, REPORT_FORMATS)
    add_watch(status)
    status.set_defaults(run=run_status)


async def status_report(
    resources: Resources, settings: Settings, args: argparse.Namespace, filters: Filters
) -> dict[str, Any]:
    from lapse.config.redact import redact_url
    from lapse.edges import health
    from lapse.edges.watch_leases import read_holders
    from lapse.events.run import Target
    from lapse.events.timeutil import format_rfc3339
    from lapse.operations.audit import OUTCOME_TYPES, audit_events, pending_schedules

    config = settings.config
    js = await resources.jetstream()
    streams = config.nats.streams
    targets = [t for t in Target if args.target in (None, t.value)]
    pending = [await pending_schedules(js, streams.schedule, t) for t in targets]
    dlq = await js.stream_info(streams.dlq)
    audit = await js.stream_info(streams.audit)
    waiting = [w for w in await health.read(js) if w.events]
    tasks = await health.read_tasks(js)
    now = time.time()
    relists = await health.read_relists(js)
    nets = await health.read_reconciles(js)
    watches = await read_holders(js)
    start = max(1, audit.state.last_seq - 50 * args.recent)
    recent = (
        [
            row
            async for event in audit_events(js, streams.audit, start_seq=start)
            if event.get_type() in OUTCOME_TYPES
            and (row := audit_row(event)) is not None
            and filters.keep(row)
        ][-args.recent :]
        if args.recent > 0
        else []
    )
    return {
        "nats": {"url": redact_url(config.nats.url), "from": settings.origins.get("nats")},
        "database": {
            "url": redact_url(config.database.url),
            "from": settings.origins.get("database"),
        },
        "pending": {
            p.target.value: {
                "count": p.count,
                "next": [{"deadline": format_rfc3339(d), "run": r} for d, r in p.next_deadlines],
                "scanned": p.scanned,
            }
            for p in pending
        },
        "deadLetters": dlq.state.messages,
        # What running lapse processes are waiting out (an API server or database down).
        "waiting": [
            {
                "function": w.function,
                "process": w.process,
                "events": w.events,
                "seconds": round(w.seconds),
                "reason": w.reason,
            }
            for w in waiting
        ],
        # Background tasks of running lapse processes waiting out a fault (a watcher with
        # the API server away): why, since when, and when they try again.
        "tasks": [
            {
                "task": t.task,
                "process": t.process,
                "state": "waiting",
                "reason": t.wait.reason,
                "since": format_rfc3339(datetime.fromtimestamp(round(t.wait.since), UTC)),
                "seconds": round(max(0.0, now - t.wait.since)),
                "nextTryInSeconds": round(max(0.0, t.wait.next_try - now)),
            }
            for t in tasks
        ],
        # Watchers listing a kind again (after 410 Gone, or with no stored position).
        "relisting": [
            {
                "kind": r.kind,
                "process": r.process,
                "listed": r.listed,
                "published": r.published,
                "seconds": round(r.seconds),
            }
            for r in relists
        ],
        # With kubernetes.watch_lease: which process watches which kind (one each).
        "watches": [
            {"kind": w.kind, "process": w.holder, "cluster": redact_url(w.cluster)} for w in watches
        ],
        # The safety net's last pass (the Knative shape's periodic reconcile): when, what
        # it found, and what went wrong.
        "safetyNet": [
            {
                "process": process,
                "lastPass": format_rfc3339(datetime.fromtimestamp(round(p["started"]), UTC)),
                "secondsAgo": round(max(0.0, now - float(p["started"]))),
                **{k: p[k] for k in ("seconds", "listed", "planned", "repaired", "errors")},
                "problems": p["problems"],
                "ok": p["ok"],
            }
            for process, p in nets
        ],
        "recent": recent,
    }


def print_report(report: dict[str, Any], args: argparse.Namespace, out: IO[str]) -> None:
    # A report, not a list: json and yaml are the report itself, and custom-columns make
    # one row of it (as kubectl's of one object).
    if args.output in ("json", "yaml"):
        document(report, args, out)
        return
    if templated(args.output, report, args, out):
        return
    nats, db = report["nats"], report["database"]
    out.write(f"nats:          {nats['url']}   (from {nats['from']})\n")
    if db["url"]:
        out.write(f"database:      {db['url']}   (from {db['from']})\n")
    for target, summary in report["pending"].items():
        nxt = ", ".join(f"{n['run']} at {n['deadline']}" for n in summary["next"]) or "-"
        out.write(f"pending {target + ':':<11}{summary['count']}   next: {nxt}\n")
    for w in report["waiting"]:
        out.write(
            f"waiting:       {w['function']} ({w['process']}): {w['events']} events for "
            f"{w['seconds']}s, {w['reason']}\n"
        )
    for t in report["tasks"]:
        out.write(
            f"waiting:       {t['task']} ({t['process']}): {t['reason']} since {t['since']} "
            f"({t['seconds']}s), next try in {t['nextTryInSeconds']}s\n"
        )
    for r in report["relisting"]:
        out.write(
            f"re-listing:    {r['kind']} ({r['process']}): {r['listed']} objects listed, "
            f"{r['published']} published again, for {r['seconds']}s\n"
        )
    for w in report.get("watches", []):
        out.write(f"watching:      {w['kind']} ({w['process']}) on {w['cluster']}\n")
    for n in report["safetyNet"]:
        problems = f"; {'; '.join(n['problems'])}" if n["problems"] else ""
        out.write(
            f"safety net:    last pass {n['lastPass']} ({n['secondsAgo']}s ago, {n['seconds']}s)"
            f" ({n['process']}): {n['listed']} finished runs seen, {n['planned']} planned, "
            f"{n['repaired']} repaired, {n['errors']} not planned{problems}\n"
        )
    out.write(f"dead letters:  {report['deadLetters']}\n\nrecent outcomes:\n")
    lines = table(
        report["recent"], RECENT_COLUMNS, wide=args.output == "wide", headers=not args.no_headers
    )
    for line in lines if report["recent"] else ["(none)"]:
        out.write(line + "\n")


def run_status(args: argparse.Namespace) -> int:
    from lapse.events.kinds import DEFAULT_KINDS
    from lapse.runtime.resources import Resources

    settings = settings_from(args)
    filters = Filters.of(args, [*settings.config.kinds, *DEFAULT_KINDS])
    if args.fleet:
        return _fleet_status(settings, args)

    async def draw(resources: Resources, out: IO[str]) -> None:
        report = await read_waiting_out_nats(
            lambda: status_report(resources, settings, args, filters)
        )
        print_report(report, args, out)

    async def work() -> None:
        async with Resources(settings.config) as resources:
            await reach_nats(resources)
            if args.watch:
                await watch(lambda out: draw(resources, out), args, "lapse status", sys.stdout)
            else:
                await draw(resources, sys.stdout)

    return run_watch(work) if args.watch else _once(work)


def _fleet_status(settings: Settings, args: argparse.Namespace) -> int:
    from lapse.cli.fleet_status import fleet_report, print_fleet_report
    from lapse.cli.history import fleet_config
    from lapse.runtime.resources import Resources

    args.cluster = None  # status has no --cluster: every cluster is one row
    config = fleet_config(settings.config, args)
    assert config is not None

    async def draw(resources: Resources, out: IO[str]) -> None:
        print_fleet_report(await read_waiting_out_nats(lambda: fleet_report(resources)), args, out)

    async def work() -> None:
        async with Resources(config) as resources:
            await reach_nats(resources)
            if args.watch:
                await watch(lambda out: draw(resources, out), args, "lapse status", sys.stdout)
            else:
                await draw(resources, sys.stdout)

    return run_watch(work) if args.watch else _once(work)


def _once(work: Callable[[], Coroutine[Any, Any, None]]) -> int:
    asyncio.run(work())
    return 0
