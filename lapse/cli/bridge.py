"""`lapse bridge`: deliver due events and outcomes from NATS to an HTTP sink (the Broker)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from lapse.cli.common import UsageError, config_from
from lapse.embedded.nats_identities import PROCESS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bridge",
        help="deliver due events and cleanup outcomes from NATS to an HTTP sink (Knative Broker)",
        description=(
            "Consume the due events NATS fires (lapse.due.>, a durable consumer shared by "
            "every replica) and POST each, in CloudEvents binary mode, to the sink: the "
            "Knative Broker the reapers' Triggers listen on; the same for each "
            "dev.lapse.cleanup.completed.v1 on the audit stream, for extensions' Triggers "
            "(from the bridge's first start on). Acked only after a 2xx; what "
            "the Broker would retry (no answer, 404, 408, 409, 429, 5xx) is retried with "
            "back-off for as long as it takes. Health on /healthz and /readyz."
        ),
    )
    parser.add_argument(
        "--sink",
        default=os.environ.get("K_SINK"),
        metavar="URL",
        help="where to POST (default: $K_SINK, as a Knative SinkBinding or ContainerSource "
        "sets it)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="health endpoints (default: %(default)s; '' turns them off)",
    )
    parser.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="where LAPSE_PROMETHEUS_PORT serves /metrics (default: $LAPSE_PROMETHEUS_HOST, "
        "else the host of --listen: no further than the HTTP endpoint; 127.0.0.1 with "
        "--listen '')",
    )
    parser.set_defaults(run=run_bridge)


def run_bridge(args: argparse.Namespace) -> int:
    from lapse.runtime import shutdown
    from lapse.runtime.bridge import Bridge

    if not args.sink:
        raise UsageError("no sink: set K_SINK or pass --sink URL")
    config = config_from(args, identity=PROCESS)
    bridge = Bridge(config, args.sink, listen=args.listen or None, metrics_host=args.metrics_host)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await bridge.run(stop)
        finally:
            shutdown.guard(loop)  # asyncio.run then waits for what is left

    asyncio.run(serve())
    return 0
