"""`lapse brake status|release`: the mass-deletion brake shared by every reaper process."""

from __future__ import annotations

import argparse
import asyncio
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from lapse.cli.common import config_from, reach_nats
from lapse.cli.names import BRAKE_TARGETS
from lapse.embedded.nats_identities import ADMIN, READER

if TYPE_CHECKING:
    from nats.js.kv import KeyValue


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    brake = subparsers.add_parser(
        "brake",
        help="the mass-deletion brake: is it engaged, release it",
        description=(
            "The mass-deletion brake is shared by every reaper process (its state is in the "
            "NATS key-value bucket LAPSE_LIMITS). When more than "
            "safety.mass_deletion_brake.max_due deletions are due within its window, "
            "deleting pauses for one window and one cleanup.failed (stage brake) is the "
            "alert. Objects and database rows each have their own brake, with the same "
            "settings."
        ),
    )
    actions = brake.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser("status", help="whether the brake is engaged, and until when")
    status.set_defaults(run=run_brake, release=False)
    _target_flag(status)
    release_ = actions.add_parser(
        "release",
        help="release an engaged brake now, for every process, with a fresh count",
        description=(
            "Release the brake for the whole deployment after looking at why it engaged "
            "(`lapse dlq list --stage brake`). Due objects that were rescheduled while it "
            "was engaged stay scheduled for the end of the pause."
        ),
    )
    release_.set_defaults(run=run_brake, release=True)
    _target_flag(release_)


def _target_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        choices=BRAKE_TARGETS,
        help="only the brake of this target (default: both; each is reported on its own line)",
    )


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def run_brake(args: argparse.Namespace) -> int:
    from lapse.edges.limits import SCOPES, limits_bucket
    from lapse.runtime.resources import Resources

    config = config_from(args, identity=ADMIN if args.release else READER)
    window = config.safety.mass_deletion_brake.window.total_seconds()

    async def act() -> str:
        async with Resources(config) as resources:
            await reach_nats(resources)
            kv = await limits_bucket(
                await resources.jetstream(), window=window, replicas=config.nats.replicas
            )
            now = datetime.now(UTC).timestamp()
            targets = [args.target] if args.target else list(SCOPES)
            lines = []
            for target in targets:
                said = await (_release if args.release else _status)(kv, SCOPES[target], now)
                lines.append(said if args.target else f"{target}: {said}")
            return "\n".join(lines)

    print(asyncio.run(act()))
    return 0


async def _release(kv: KeyValue, scope: str, now: float) -> str:
    from lapse.edges.limits import release

    was = await release(kv, scope)
    if was is None or was.until <= now:
        return "brake was not engaged; counts reset"
    return f"released (engaged since {_when(was.since)}, until {_when(was.until)})"


async def _status(kv: KeyValue, scope: str, now: float) -> str:
    from lapse.edges.limits import engaged

    current, _ = await engaged(kv, scope)
    if current is None or current.until <= now:
        return "not engaged"
    return f"engaged since {_when(current.since)}, until {_when(current.until)}"
