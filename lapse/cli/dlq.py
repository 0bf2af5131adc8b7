"""`lapse dlq`: the dead letters, and their repair (list, show, replay, purge).

Nothing asks for confirmation, so replay and purge insist on being told what: IDs, a
filter, or `--all`; `--dry-run` shows what they would do. The logic is in
lapse.operations.dlq.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

from lapse.cli.common import UsageError, config_from, warn
from lapse.cli.fleet_ask import add_cluster, ask_hub, from_hub
from lapse.cli.names import TARGETS
from lapse.cli.output import REPORT_FORMATS, Column, add_output, aligned, emit
from lapse.embedded.nats_identities import ADMIN

if TYPE_CHECKING:
    from lapse.config import LapseConfig
    from lapse.operations.dlq import Filter

COLUMNS = ("id", "time", "namespace", "name", "target", "stage", "reason")


# `dlq list`: the columns above, and with -o wide the run's uid and the attempts made.
def _field(name: str) -> Column:
    return Column(name.upper(), lambda row: row.get(name))


CLUSTER = Column("CLUSTER", lambda r: r["cluster"])
LIST_COLUMNS = [
    *(_field(name) for name in COLUMNS),
    Column("UID", lambda r: r.get("uid"), wide_only=True),
    Column("ATTEMPTS", lambda r: r.get("attempts"), wide_only=True),
]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dlq = subparsers.add_parser(
        "dlq",
        help="dead letters: list, show, replay, purge",
        description=(
            "The dead letters: cleanups that failed for good (a refused DELETE, invalid "
            "input), each with its reason and the event that failed. Replay sends that event "
            "back once its cause is fixed; purge removes entries."
        ),
    )
    actions = dlq.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="the dead letters that match the filters")
    _filters(listing)
    add_cluster(listing, fleet=True)
    add_output(listing, REPORT_FORMATS)
    listing.set_defaults(run=run_list)

    show = actions.add_parser("show", help="one dead letter in full, with its original event")
    show.add_argument("id", metavar="ID", help="the entry's ID (from `list`) or its event id")
    _output(show, default="json")
    show.set_defaults(run=run_show)

    for name, helptext, run in (
        (
            "replay",
            "send the failed events back where they are handled (after fixing the cause)",
            run_replay,
        ),
        ("purge", "remove dead letters", run_purge),
    ):
        action = actions.add_parser(name, help=helptext, description=helptext)
        action.add_argument("ids", nargs="*", metavar="ID", help="entries by ID")
        _filters(action)
        action.add_argument("--all", action="store_true", help="every dead letter")
        action.add_argument("--dry-run", action="store_true", help="show, change nothing")
        if name == "replay":
            add_cluster(action)
        _output(action)
        action.set_defaults(run=run)


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", help="only runs in this namespace")
    parser.add_argument("--name", help="only runs with this name")
    parser.add_argument(
        "--target",
        choices=TARGETS,
        help="only this target (kubernetes or database)",
    )
    parser.add_argument("--stage", help="only this stage (object-reaper, ingress, ...)")
    parser.add_argument("--reason", help="only reasons containing this text (any case)")
    parser.add_argument("--since", help="only the last DURATION (e.g. 1h, 7d)")


def _output(parser: argparse.ArgumentParser, default: str = "table") -> None:
    parser.add_argument(
        "-o", "--output", choices=("table", "json"), default=default,
        help="table for people, json for scripts (default: %(default)s)",
    )  # fmt: skip


def selection(args: argparse.Namespace) -> Filter:
    from lapse.functions.durations import parse_duration
    from lapse.operations.dlq import Filter

    since = None
    if args.since:
        try:
            since = datetime.now(UTC) - parse_duration(args.since, what="--since")
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    ids: set[int] = set()
    for ident in getattr(args, "ids", None) or ():
        if not ident.isdigit():
            raise UsageError(f"{ident!r} is not a dead letter ID (a number, from `lapse dlq list`)")
        ids.add(int(ident))
    return Filter(
        namespace=args.namespace,
        name=args.name,
        target=args.target,
        stage=args.stage,
        reason=args.reason,
        since=since,
        ids=frozenset(ids),
    )


def _explicit(args: argparse.Namespace, chosen: Filter) -> Filter:
    if chosen.narrows and args.all:
        raise UsageError(f"dlq {args.action}: --all cannot be combined with IDs or filters")
    if not chosen.narrows and not args.all:
        raise UsageError(
            f"dlq {args.action}: say which entries: IDs, a filter (-n, --name, --target, "
            "--stage, --reason, --since) or --all"
        )
    return chosen


async def _rows(config: LapseConfig, args: argparse.Namespace, chosen: Filter) -> list[Any]:
    from lapse.operations.dlq import dead_letters
    from lapse.runtime.resources import Resources

    async with Resources(config, nats_url=args.nats_url) as resources:
        js = await resources.jetstream()
        return [letter async for letter in dead_letters(js, config.nats.streams.dlq, chosen)]


def run_list(args: argparse.Namespace) -> int:
    if from_hub(args):
        from lapse.operations.fleet_actions import filter_document

        body = {"filter": filter_document(selection(args))}
        rows = []
        for answer in ask_hub(args, "dlq-list", body):
            if answer.get("more"):
                warn(f"cluster {answer['cluster']}: more dead letters than listed (filter)")
            rows += [{"cluster": answer["cluster"], **row} for row in answer["items"]]
        emit(rows, [CLUSTER, *LIST_COLUMNS], args, sys.stdout)
        return 0
    config = config_from(args)
    letters = asyncio.run(_rows(config, args, selection(args)))
    emit([letter.row() for letter in letters], LIST_COLUMNS, args, sys.stdout)
    return 0


def run_show(args: argparse.Namespace) -> int:
    from lapse.operations.dlq import DeadLetterNotFound, dead_letter, replay_problem
    from lapse.runtime.resources import Resources

    config = config_from(args)

    async def show() -> dict[str, Any]:
        async with Resources(config, nats_url=args.nats_url) as resources:
            js = await resources.jetstream()
            streams = config.nats.streams
            try:
                letter = await dead_letter(js, streams.dlq, args.id)
            except DeadLetterNotFound as exc:
                raise UsageError(str(exc)) from exc
            return {**letter.document(), "replayProblem": await replay_problem(js, streams, letter)}

    document = asyncio.run(show())
    if args.output == "json":
        _json(document)
        return 0
    for key in (*COLUMNS, "uid", "attempts", "originalType", "replayProblem"):
        print(f"{key}: {document.get(key) if document.get(key) is not None else '-'}")
    print("original:")
    _json(document["original"])
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from lapse.operations.dlq import dead_letters, replay
    from lapse.runtime.resources import Resources

    chosen = _explicit(args, selection(args))
    if args.cluster:
        from lapse.operations.fleet_actions import filter_document

        body = {"filter": filter_document(chosen), "all": args.all, "dryRun": args.dry_run}
        [answer] = ask_hub(args, "dlq-replay", body)
        _print_replay(args, {k: answer[k] for k in ("replayed", "removed", "left")})
        return 0
    config = config_from(args, identity=ADMIN)

    async def go() -> dict[str, Any]:
        async with Resources(config, nats_url=args.nats_url) as resources:
            js = await resources.jetstream()
            streams = config.nats.streams
            letters = [letter async for letter in dead_letters(js, streams.dlq, chosen)]
            report = await replay(js, streams, letters, dry_run=args.dry_run)
            return report.summary()

    _print_replay(args, asyncio.run(go()))
    return 0


def _print_replay(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    if args.output == "json":
        _json(summary)
        return
    verb = "would replay" if args.dry_run else "replayed"
    _table(f"{verb} {len(summary['replayed'])} event(s)", summary["replayed"], ("subject",))
    if not args.dry_run:
        print(f"removed {len(summary['removed'])} dead letter(s)")
    if summary["left"]:
        _table(
            f"left in place: {len(summary['left'])} (not replayable)",
            summary["left"],
            ("problem",),
        )


def run_purge(args: argparse.Namespace) -> int:
    from lapse.operations.dlq import dead_letters, purge
    from lapse.runtime.resources import Resources

    config = config_from(args, identity=ADMIN)
    chosen = _explicit(args, selection(args))

    async def go() -> list[int]:
        async with Resources(config, nats_url=args.nats_url) as resources:
            js = await resources.jetstream()
            stream = config.nats.streams.dlq
            letters = [letter async for letter in dead_letters(js, stream, chosen)]
            return await purge(js, stream, letters, dry_run=args.dry_run)

    removed = asyncio.run(go())
    if args.output == "json":
        _json({"dryRun": args.dry_run, "removed": removed})
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(removed)} dead letter(s)" + (f": {_ids(removed)}" if removed else ""))
    return 0


def _ids(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:20])
    return shown + (f" (and {len(ids) - 20} more)" if len(ids) > 20 else "")


def _json(value: object) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    print()


def _table(
    title: str, rows: list[dict[str, Any]], extra: tuple[str, ...] = (), out: IO[str] = sys.stdout
) -> None:
    """A title line, then plain aligned columns (as every lapse table: no boxes, no colour)."""
    columns = (*COLUMNS, *extra)
    cells = [[c.upper() for c in columns]]
    cells += [[str(row.get(c)) if row.get(c) is not None else "" for c in columns] for row in rows]
    out.write(title + "\n")
    for line in aligned(cells):
        out.write(line + "\n")
