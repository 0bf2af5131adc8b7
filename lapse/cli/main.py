# PYTHON_ARGCOMPLETE_OK  (argcomplete: this script completes itself)
"""The `lapse` command line: parses arguments, runs one command, maps errors to exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error. Errors are printed as
one line; `--debug` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import version

import argcomplete
from kubernetes.config.config_exception import ConfigException

from lapse.cli import (
    brake,
    bridge,
    completion,
    demo,
    dlq,
    history,
    infra,
    plan,
    reconcile,
    serve,
    status,
    up,
)
from lapse.cli.common import UsageError
from lapse.cli.parsing import EXIT_USAGE, HelpFormatter, LapseParser, global_options
from lapse.config import ConfigError
from lapse.embedded.nats import MissingExtra
from lapse.runtime.resources import MissingSetting
from lapse.telemetry import TelemetryError

EXIT_OK = 0
EXIT_FAILURE = 1

# What the user fixes (flags, configuration, installation): exit 2.
USAGE_ERRORS = (UsageError, ConfigError, MissingSetting, TelemetryError, MissingExtra)

KUBE_CONFIG_HELP = (
    "Kubernetes configuration: {reason} (set --kubeconfig and --context, $KUBECONFIG, or "
    "kubernetes.kubeconfig / LAPSE_KUBERNETES__KUBECONFIG; kubernetes.in_cluster in a pod; "
    "`lapse up` starts a local cluster when none is configured)"
)

Command = Callable[[argparse.Namespace], int]


def build_parser() -> LapseParser:
    parser = LapseParser(
        prog="lapse",
        description=(
            "Event-driven cleanup of finished workflow runs: deletes Kubernetes objects and "
            "database rows when their deadlines come due. Global flags may come before or "
            "after the command."
        ),
        formatter_class=HelpFormatter,
        parents=[global_options(after_command=False)],
    )
    parser.add_argument("--version", action="version", version=f"lapse {version('lapse')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (
        up,
        demo,
        plan,
        reconcile,
        history,
        status,
        dlq,
        brake,
        serve,
        bridge,
        infra,
        completion,
    ):
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argcomplete.autocomplete(parser)  # returns at once unless a shell is asking
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command != "up" and not args.debug:
        # nats-py, lapse's NATS edge and urllib3 log each failed connection attempt (nats-py with a
        # traceback); a command's own one-line error says what matters. `lapse up` keeps
        # them: there they tell that a server went away.
        # On the handlers: the Kubernetes client resets the urllib3 logger's level.
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_retries)
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE if args.command is None and argv else EXIT_OK
    try:
        return run(args)
    except USAGE_ERRORS as exc:
        return _fail(args, str(exc), EXIT_USAGE)
    except ConfigException as exc:
        # The Kubernetes client's "Invalid kube-config file. No configuration found." (or
        # an unknown context): a configuration problem, so it says what to set.
        reason = " ".join(str(exc).split())
        missing = _missing_kubeconfig_env()
        if missing is not None:  # name the path the user set, not the client's guess
            reason = f"$KUBECONFIG {missing}: file not found"
        return _fail(args, KUBE_CONFIG_HELP.format(reason=reason), EXIT_USAGE)
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception as exc:
        return _fail(args, str(exc) or type(exc).__name__, EXIT_FAILURE)


# Loggers that report each failed connection attempt (nats-py, lapse's NATS edge, urllib3).
_RETRY_LOGGERS = ("nats.", "lapse.edges.nats", "urllib3.")


def _quiet_retries(record: logging.LogRecord) -> bool:
    return not record.name.startswith(_RETRY_LOGGERS) or record.levelno >= logging.CRITICAL


def _missing_kubeconfig_env() -> str | None:
    value = os.environ.get("KUBECONFIG")
    if not value:
        return None
    paths = [p for p in value.split(os.pathsep) if p]
    return value if not any(os.path.isfile(os.path.expanduser(p)) for p in paths) else None


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"lapse: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
