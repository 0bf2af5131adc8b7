"""`lapse infra apply`: create or update the JetStream streams lapse needs."""

from __future__ import annotations

import argparse
import asyncio

from lapse.cli.common import config_from, reach_nats
from lapse.edges.streams import ensure_streams, stream_configs
from lapse.runtime.resources import Resources


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
            "names, replicas and audit retention from the configuration. Safe to run again."
        ),
    )
    apply.set_defaults(run=run_apply)


def run_apply(args: argparse.Namespace) -> int:
    config = config_from(args)

    async def apply() -> list[str]:
        async with Resources(config) as resources:
            await reach_nats(resources)
            js = await resources.jetstream()
            return await ensure_streams(
                js,
                stream_configs(
                    config.nats.streams,
                    replicas=config.nats.replicas,
                    audit_max_age=config.nats.audit_max_age,
                ),
            )

    for line in asyncio.run(apply()):
        print(line)
    return 0
