"""The `lapse` command line: parses arguments, runs one command, maps errors to exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error. Errors are printed as
one line; `--debug` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import version

from lapse.cli import bridge, demo, dlq, history, infra, plan, reconcile, serve, status, up
from lapse.cli.common import UsageError
from lapse.config import ConfigError
from lapse.runtime.resources import MissingSetting
from lapse.telemetry import TelemetryError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lapse",
        description=(
            "Event-driven cleanup of finished workflow runs: deletes Kubernetes objects and "
            "database rows when their deadlines come due."
        ),
    )
    parser.add_argument("--version", action="version", version=f"lapse {version('lapse')}")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="configuration file (default: $LAPSE_CONFIG, else built-in defaults)",
    )
    parser.add_argument("--debug", action="store_true", help="verbose logs and full tracebacks")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (up, demo, plan, reconcile, history, status, dlq, serve, bridge, infra):
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE if args.command is None and argv else EXIT_OK
    try:
        return run(args)
    except (UsageError, ConfigError, MissingSetting, TelemetryError) as exc:
        print(f"lapse: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(f"lapse: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
