"""`lapse serve FUNCTION`: one function over HTTP, exactly as Knative serves it."""

from __future__ import annotations

import argparse
import os

from lapse.cli.names import FUNCTIONS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve one function over HTTP, as Knative would",
        description=(
            "Serve one lapse function with func-python (the Knative Python functions "
            "runtime): CloudEvents in by HTTP POST, health on /health/liveness and "
            "/health/readiness. Configuration comes from the environment (LAPSE_CONFIG, "
            "LAPSE_<SECTION>__<KEY>), as in a Knative Service."
        ),
    )
    parser.add_argument("function", choices=FUNCTIONS, help="which function")
    parser.add_argument(
        "--listen",
        default=os.environ.get("LISTEN_ADDRESS", "127.0.0.1:8080"),
        metavar="HOST:PORT",
        help="address to serve on (default: $LISTEN_ADDRESS or %(default)s)",
    )
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from func_python.cloudevent import ASGIApplication

    from lapse.runtime.knative import FunctionShell

    # func-python reads its bind address from the environment, like Knative sets it.
    os.environ["LISTEN_ADDRESS"] = args.listen
    if getattr(args, "config", None):
        os.environ["LAPSE_CONFIG"] = args.config
    ASGIApplication(FunctionShell(args.function)).serve()
    return 0
