"""`--cluster C` on the commands that act (brake, dlq replay) and `--fleet` on the reads
(dlq list): sent from the fleet's hub to the cluster that owns the state, carried out by
that cluster's own lapse up (lapse/operations/fleet_actions.py; docs/fleet.md)."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

from lapse.cli.common import Unreachable, UsageError, config_from

if TYPE_CHECKING:
    from lapse.config import LapseConfig

# How long a command waits for the cluster's answer: a dlq replay publishes one event per
# entry and waits for each to be stored.
ANSWER_SECONDS = 60.0


def add_cluster(parser: argparse.ArgumentParser, *, fleet: bool = False) -> None:
    """`--cluster` (and with `fleet`, `--fleet`): ask the hub instead of this cluster."""
    from lapse.cli.history import _cluster_name

    if fleet:
        parser.add_argument(
            "--fleet",
            action="store_true",
            help="every cluster of the fleet (fleet.clusters), asked through its hub, with "
            "a CLUSTER column",
        )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        type=_cluster_name,
        help="this cluster of the fleet: sent through the hub (fleet.hub) and carried out "
        "by that cluster's own lapse up (docs/fleet.md)",
    )


def from_hub(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "fleet", False) or args.cluster)


def clusters_of(args: argparse.Namespace, config: LapseConfig) -> tuple[str, ...]:
    if args.cluster:
        return (args.cluster,)
    if not config.fleet.clusters:
        raise UsageError("--fleet asks every cluster of fleet.clusters: list them there")
    return config.fleet.clusters


def ask_hub(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each chosen cluster's answer to `verb`, in cluster order (with its name in
    `cluster`); the first refusal or silence ends the command (exit 1)."""
    from lapse.cli.history import fleet_config
    from lapse.edges.nats import connect
    from lapse.operations.fleet_actions import ask

    config = config_from(args)
    hub = fleet_config(config, argparse.Namespace(fleet=True, cluster=None))
    assert hub is not None
    clusters = clusters_of(args, config)

    async def go() -> list[dict[str, Any]]:
        url = hub.nats.url
        assert url is not None
        try:
            nc = await asyncio.wait_for(connect(url, config=hub.nats), 10)
        except (TimeoutError, OSError) as exc:
            raise Unreachable(f"no answer from the fleet's hub within 10s: {exc}") from exc
        try:
            return [
                await ask(nc, cluster, verb, body, timeout=ANSWER_SECONDS) for cluster in clusters
            ]
        finally:
            await nc.close()

    return asyncio.run(go())
