"""`lapse brake status|engage|release`: the mass-deletion brake shared by every reaper
process; with `--cluster`, one cluster's, from the fleet's hub (docs/fleet.md)."""

from __future__ import annotations

import argparse
import asyncio

from lapse.cli.common import UsageError, config_from, reach_nats
from lapse.cli.names import BRAKE_TARGETS
from lapse.embedded.nats_identities import ADMIN, READER


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
    status.set_defaults(run=run_brake, action="status")
    _flags(status)
    engage_ = actions.add_parser(
        "engage",
        help="pause deleting now, for every process, until --for has passed",
        description=(
            "Engage the brake by hand (an incident, a migration): deleting pauses for "
            "every process once it next reads the brake (after the few deletions it already "
            "counted in: a fiftieth of max_due at most); due objects are rescheduled for "
            "the end of the pause. `lapse brake release` ends it sooner."
        ),
    )
    engage_.add_argument(
        "--for",
        dest="duration",
        metavar="DURATION",
        help="how long (1m, 2h; default: safety.mass_deletion_brake.window)",
    )
    engage_.set_defaults(run=run_brake, action="engage")
    _flags(engage_)
    release_ = actions.add_parser(
        "release",
        help="release an engaged brake now, for every process, with a fresh count",
        description=(
            "Release the brake for the whole deployment after looking at why it engaged "
            "(`lapse dlq list --stage brake`). Due objects that were rescheduled while it "
            "was engaged stay scheduled for the end of the pause."
        ),
    )
    release_.set_defaults(run=run_brake, action="release")
    _flags(release_)


def _flags(parser: argparse.ArgumentParser) -> None:
    from lapse.cli.fleet_ask import add_cluster

    parser.add_argument(
        "--target",
        choices=BRAKE_TARGETS,
        help="only the brake of this target (default: both; each is reported on its own line)",
    )
    add_cluster(parser)


def _seconds(args: argparse.Namespace) -> float | None:
    from lapse.functions.durations import parse_duration

    if getattr(args, "duration", None) is None:
        return None
    try:
        seconds = parse_duration(args.duration, what="--for").total_seconds()
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if seconds <= 0:
        raise UsageError("--for: a positive duration (1m, 2h)")
    return seconds


def _lines(said: dict[str, str], args: argparse.Namespace, cluster: str | None = None) -> str:
    prefix = f"{cluster}: " if cluster else ""
    return "\n".join(
        prefix + (line if args.target else f"{target}: {line}") for target, line in said.items()
    )


def run_brake(args: argparse.Namespace) -> int:
    from lapse.cli.fleet_ask import ask_hub
    from lapse.operations.brake import move_brake
    from lapse.runtime.resources import Resources

    seconds = _seconds(args)
    if args.cluster:
        body = {"target": args.target, "seconds": seconds}
        [answer] = ask_hub(args, f"brake-{args.action}", body)
        print(_lines(answer["brake"], args, answer["cluster"]))
        return 0
    config = config_from(args, identity=READER if args.action == "status" else ADMIN)

    async def act() -> dict[str, str]:
        async with Resources(config) as resources:
            await reach_nats(resources)
            js = await resources.jetstream()
            return await move_brake(js, config, args.action, args.target, seconds=seconds)

    print(_lines(asyncio.run(act()), args))
    return 0
