"""`lapse infra apply`: create or update the JetStream streams lapse needs."""

from __future__ import annotations

import argparse
import asyncio

from lapse.cli.common import config_from, reach_nats
from lapse.embedded.nats_identities import ADMIN


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    infra = subparsers.add_parser(
        "infra", help="manage what lapse needs in NATS", description="Manage lapse's NATS streams."
    )
    actions = infra.add_subparsers(dest="action", metavar="ACTION", required=True)
    apply = actions.add_parser(
        "apply",
        help="create or update the streams (idempotent)",
        description=(
            "Create or update the JetStream streams from infra/nats/streams.yaml, with the "
            "names, replicas, placement and audit retention from the configuration (nats:). "
            "Safe to run again; a changed replica count or placement is applied in place."
        ),
    )
    apply.set_defaults(run=run_apply)


def run_apply(args: argparse.Namespace) -> int:
    from lapse.edges.streams import configured_streams, ensure_streams
    from lapse.runtime.resources import Resources

    config = config_from(args, identity=ADMIN)

    async def apply() -> list[str]:
        async with Resources(config) as resources:
            await reach_nats(resources)
            js = await resources.jetstream()
            return await ensure_streams(js, configured_streams(config.nats))

    for line in asyncio.run(apply()):
        print(line)
    return 0
