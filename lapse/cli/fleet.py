"""`lapse fleet conf|apply`: the fleet's hub (docs/fleet.md) — the hub's nats-server
configuration with one leaf identity per cluster, and the hub's streams sourcing every
cluster's outcomes and lifecycle events."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

from lapse.cli.common import UsageError, config_from, reach_nats


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fleet = subparsers.add_parser(
        "fleet",
        help="the fleet's hub: its NATS configuration and streams",
        description=(
            "The fleet's hub (docs/fleet.md): each cluster's lapse keeps its deadlines in "
            "its own JetStream domain, a leaf node of the hub; the hub sources every "
            "cluster's outcomes and lifecycle events. The clusters are fleet.clusters."
        ),
    )
    actions = fleet.add_subparsers(dest="action", metavar="ACTION", required=True)
    conf = actions.add_parser(
        "conf",
        help="print the hub's nats-server configuration",
        description=(
            "Print the hub's nats-server configuration: JetStream in the domain `hub`, the "
            "leaf node port, the hub's identities (lapse-hub-admin, lapse-hub-reader) and "
            "one leaf identity per cluster (lapse-leaf-<cluster>), each allowed its own "
            "cluster's subjects only. Passwords are $VARIABLEs the server reads from its "
            "environment (LAPSE_LEAF_<CLUSTER>_PASSWORD, ...): none is printed."
        ),
    )
    conf.add_argument("--port", type=int, default=4222, help="the client port (4222)")
    conf.add_argument("--leaf-port", type=int, default=7422, help="the leaf node port (7422)")
    conf.add_argument("--store-dir", default="/data", help="JetStream's store (/data)")
    conf.set_defaults(run=run_conf)
    apply = actions.add_parser(
        "apply",
        help="create or update the hub's streams (idempotent)",
        description=(
            "Create or update the hub's streams LAPSE_FLEET_AUDIT and LAPSE_FLEET_EVENTS, "
            "each sourcing every cluster of fleet.clusters from its JetStream domain, as "
            "the identity of fleet.hub (lapse-hub-admin). A cluster added to the list is "
            "sourced from its first event on; one removed is no longer sourced (its events "
            "already on the hub stay until they age out)."
        ),
    )
    apply.set_defaults(run=run_apply)


def _clusters(args: argparse.Namespace) -> tuple[str, ...]:
    clusters = config_from(args).fleet.clusters
    if not clusters:
        raise UsageError("no clusters: list them in fleet.clusters (docs/fleet.md)")
    return clusters


def run_conf(args: argparse.Namespace) -> int:
    from lapse.embedded.fleet_identities import hub_password_variables, hub_settings

    clusters = _clusters(args)
    variables = hub_password_variables(clusters)
    settings = hub_settings(
        clusters,
        {user: f"@{variable}@" for user, variable in variables.items()},
        leaf_listen=f"0.0.0.0:{args.leaf_port}",
    )
    body = json.dumps(
        {
            "port": args.port,
            **settings,
            "jetstream": {**settings["jetstream"], "store_dir": args.store_dir},
        },
        indent=2,
    )
    print("# The fleet hub's nats-server configuration (lapse fleet conf; docs/fleet.md).")
    print("# Passwords: " + ", ".join(f"${v}" for v in variables.values()))
    print(re.sub(r'"@(\w+)@"', r"$\1", body))
    return 0


def run_apply(args: argparse.Namespace) -> int:
    from lapse.edges.fleet_streams import hub_stream_configs
    from lapse.edges.streams import ensure_streams
    from lapse.runtime.resources import Resources

    config = config_from(args)
    if config.fleet.hub is None:
        raise UsageError("lapse fleet apply writes to the hub: set fleet.hub (docs/fleet.md)")
    clusters = _clusters(args)
    hub = config.model_copy(update={"nats": config.fleet.hub.as_nats()})
    configs = hub_stream_configs(
        clusters, audit_max_age=config.nats.audit_max_age, streams=config.nats.streams
    )

    async def apply() -> list[str]:
        async with Resources(hub) as resources:
            await reach_nats(resources)
            js = await resources.jetstream()
            return await ensure_streams(js, configs)

    for line in asyncio.run(apply()):
        print(line)
    return 0
