"""`lapse history`: the audit trail, what lapse did and why."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Final

from lapse.cli.common import (
    UsageError,
    add_namespace,
    config_from,
    in_namespace,
    kubernetes_kind,
    namespace_of,
    reach_nats,
    read_waiting_out_nats,
)
from lapse.cli.names import KNOWN_KINDS, OUTCOMES, TARGETS
from lapse.cli.output import Column, Row, add_output, emit, human_bytes, resource_name
from lapse.cli.parsing import closed_set, offer
from lapse.cli.watch import add_watch, run_watch, watch

if TYPE_CHECKING:
    from cloudevents.core.base import BaseCloudEvent
    from nats.js import JetStreamContext

    from lapse.config import LapseConfig
    from lapse.events.kinds import KindSpec
    from lapse.runtime.resources import Resources


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    history = subparsers.add_parser(
        "history",
        help="the audit trail: what was deleted, when, why",
        description=(
            "Print the audit trail from the audit stream: every cleanup outcome (deleted, "
            "already gone, kept, skipped, rescheduled, dry run, failed) with its deadline, "
            "lateness and reason; for the artifacts target, the objects deleted and bytes "
            "freed (FREED; bytesFreed and objectsDeleted in json/yaml), with their total "
            "under the table. Use --all to include schedules and cancellations."
        ),
    )
    add_namespace(history)
    history.add_argument("--name", help="only runs with this name")
    add_filters(history)
    history.add_argument(
        "--outcome",
        type=closed_set("outcome", OUTCOMES),
        metavar="OUTCOME",
        help=f"only this outcome ({', '.join(OUTCOMES)})",
    )
    history.add_argument("--since", metavar="DURATION", help="only the last DURATION (1h, 7d)")
    history.add_argument("--all", action="store_true", help="also scheduled/cancelled events")
    add_fleet(history)
    add_output(history)
    add_watch(history)
    history.set_defaults(run=run_history)


def add_fleet(parser: argparse.ArgumentParser) -> None:
    """`--fleet` and `--cluster`: answer from the fleet's hub (docs/fleet.md)."""
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="every cluster of the fleet, from its hub (fleet.hub), with a CLUSTER column",
    )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        type=_cluster_name,
        help="only this cluster of the fleet, from its hub (implies --fleet)",
    )


def _cluster_name(text: str) -> str:
    # A token of the hub's subjects: a wildcard or a dot would read other clusters' rows.
    from pydantic import TypeAdapter, ValidationError

    from lapse.config.schema import ClusterName

    try:
        return TypeAdapter(ClusterName).validate_python(text)
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a cluster name (lower-case letters, digits and '-')"
        ) from None


def fleet_config(config: LapseConfig, args: argparse.Namespace) -> LapseConfig | None:
    """With --fleet or --cluster: `config` connecting to the hub instead of this
    cluster's NATS; None without them."""
    if not (args.fleet or args.cluster):
        return None
    hub = config.fleet.hub
    if hub is None:
        raise UsageError(
            "--fleet and --cluster read from the fleet's hub: set fleet.hub.url (and its "
            "credentials: fleet.hub.user and fleet.hub.password_file) in lapse.yaml "
            "(docs/fleet.md)"
        )
    return config.model_copy(update={"nats": hub.as_nats()})


def add_filters(parser: argparse.ArgumentParser) -> None:
    """`--kind` and `--target`, shared with `lapse status`."""
    kind = parser.add_argument(
        "--kind",
        help="only runs of this kind (Workflow, PipelineRun, Job; case-insensitive)",
    )
    offer(kind, KNOWN_KINDS)
    parser.add_argument(
        "--target",
        choices=TARGETS,
        help="only this target: the Kubernetes object or the database rows",
    )


def audit_row(event: BaseCloudEvent) -> Row | None:
    """`history_row` plus the run's kind and apiVersion, for `--kind` and `-o name`."""
    from lapse.events.builder import parse_payload
    from lapse.events.errors import InvalidEvent
    from lapse.operations.audit import history_row

    row = history_row(event)
    if row is None:
        return None
    try:
        run = getattr(parse_payload(event), "run", None)
    except InvalidEvent:
        run = None
    row["kind"] = run.kind if run else None
    row["apiVersion"] = run.api_version if run else None
    row["objectsDeleted"], row["bytesFreed"] = freed(row)
    return row


# How the artifact reaper records what it deleted: the first part of its outcome's detail
# (`describe` in lapse/functions/artifact_reaper/handler.py; tests/cli/test_history_status.py
# reads one back through it, so a change there fails here).
_DELETED: Final = re.compile(r"^deleted (\d+) objects, (\d+) bytes(?:;|$)")


def freed(row: Row) -> tuple[int | None, int | None]:
    """(objects deleted, bytes freed) by an artifacts outcome that deleted; (None, None)
    where nothing says (other targets, dry runs, failures, a detail of another shape)."""
    from lapse.events.run import Target
    from lapse.events.types import Outcome

    if row.get("target") != Target.ARTIFACTS.value or row.get("outcome") != Outcome.DELETED.value:
        return None, None
    match = _DELETED.match(str(row.get("detail") or ""))
    if match is None:
        return None, None
    return int(match.group(1)), int(match.group(2))


def total_line(rows: list[Row]) -> str | None:
    """What the rows' artifacts outcomes freed together; None when none says."""
    counted = [r for r in rows if r.get("bytesFreed") is not None]
    if not counted:
        return None
    objects = sum(int(r["objectsDeleted"]) for r in counted)
    size = sum(int(r["bytesFreed"]) for r in counted)
    runs = "run" if len(counted) == 1 else "runs"
    return (
        f"freed in total: {human_bytes(size)} ({size} bytes) in {objects} objects, "
        f"artifacts of {len(counted)} {runs}"
    )


@dataclass(frozen=True)
class Filters:
    """What `history` and `status` filter rows by; built once, so a deprecation warning
    about `-n` is printed once."""

    namespace: str | None = None
    pattern: str | None = None
    name: str | None = None
    kind: str | None = None
    target: str | None = None
    outcome: str | None = None

    @classmethod
    def of(cls, args: argparse.Namespace, kinds: Iterable[KindSpec] | None = None) -> Filters:
        namespace, pattern = namespace_of(args) if hasattr(args, "namespace") else (None, None)
        return cls(
            namespace,
            pattern,
            getattr(args, "name", None),
            kubernetes_kind(args.kind, kinds) if args.kind and kinds is not None else args.kind,
            args.target,
            getattr(args, "outcome", None),
        )

    def keep(self, row: Row) -> bool:
        if (self.namespace or self.pattern) and not in_namespace(
            str(row.get("namespace") or ""), self.namespace, self.pattern
        ):
            return False
        if self.kind and str(row.get("kind") or "").lower() != self.kind.lower():
            return False
        wanted = {"name": self.name, "target": self.target, "outcome": self.outcome}
        return all(value is None or row.get(key) == value for key, value in wanted.items())


def _since(args: argparse.Namespace) -> datetime | None:
    if not args.since:
        return None
    from lapse.functions.durations import parse_duration

    try:
        return datetime.now(UTC) - parse_duration(args.since, what="--since")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


async def read_rows(
    resources: Resources, config: LapseConfig, args: argparse.Namespace, filters: Filters
) -> list[Row]:
    from lapse.operations.audit import OUTCOME_TYPES

    js = await resources.jetstream()
    rows = []
    async for cluster, event in _events(js, config, args):
        if not args.all and event.get_type() not in OUTCOME_TYPES:
            continue
        row = audit_row(event)
        if row is not None and filters.keep(row):
            rows.append(row if cluster is None else {"cluster": cluster, **row})
    return rows


async def _events(
    js: JetStreamContext, config: LapseConfig, args: argparse.Namespace
) -> AsyncIterator[tuple[str | None, BaseCloudEvent]]:
    """(cluster, event): this cluster's own audit stream (cluster None), or the hub's."""
    from lapse.operations.audit import audit_events, fleet_audit_events

    if args.fleet or args.cluster:
        async for named, event in fleet_audit_events(js, cluster=args.cluster, since=_since(args)):
            yield named, event
        return
    async for event in audit_events(js, config.nats.streams.audit, since=_since(args)):
        yield None, event


CLUSTER = Column("CLUSTER", lambda r: r["cluster"])
COLUMNS = [
    Column("TIME", lambda r: r["time"]),
    Column("NAMESPACE", lambda r: r["namespace"]),
    Column("NAME", lambda r: r["name"]),
    Column("KIND", lambda r: r["kind"], wide_only=True),
    Column("TARGET", lambda r: r["target"]),
    Column("EVENT", lambda r: r["event"], wide_only=True),
    Column("OUTCOME", lambda r: r["outcome"]),
    Column("LATE (S)", lambda r: r["latencySeconds"]),
    Column("FREED", lambda r: human_bytes(r.get("bytesFreed"))),
    Column("DEADLINE", lambda r: r["deadline"], wide_only=True),
    Column("UID", lambda r: r["uid"], wide_only=True),
    Column("DETAIL", lambda r: r["detail"]),
]


def _name(row: Row) -> str:
    return resource_name(row.get("apiVersion"), row.get("kind"), row.get("name"))


def run_history(args: argparse.Namespace) -> int:
    from lapse.events.kinds import DEFAULT_KINDS
    from lapse.runtime.resources import Resources

    config = config_from(args)
    # Usage problems (and the deprecation warning) first; the audit trail may hold a
    # built-in kind no longer configured.
    filters = Filters.of(args, [*config.kinds, *DEFAULT_KINDS])
    hub = fleet_config(config, args)
    columns = COLUMNS if hub is None else [CLUSTER, *COLUMNS]
    config = hub or config

    async def draw(resources: Resources, out: IO[str]) -> None:
        rows = await read_waiting_out_nats(lambda: read_rows(resources, config, args, filters))
        emit(rows, columns, args, out, name=_name)
        # Under the table, for people: json and yaml stay a list of rows (sum bytesFreed),
        # and without headers the table stays rows alone, for awk and grep.
        total = total_line(rows)
        if total and args.output in ("table", "wide") and not args.no_headers:
            out.write(total + "\n")

    if args.watch:

        async def live() -> None:
            async with Resources(config) as resources:
                await reach_nats(resources)
                await watch(lambda out: draw(resources, out), args, "lapse history", sys.stdout)

        return run_watch(live)

    async def once() -> None:
        async with Resources(config) as resources:
            await reach_nats(resources)
            await draw(resources, sys.stdout)

    asyncio.run(once())
    return 0
