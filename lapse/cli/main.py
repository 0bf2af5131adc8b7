# PYTHON_ARGCOMPLETE_OK  (argcomplete: this script completes itself)
"""The `lapse` command line: parses arguments, runs one command, maps errors to exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error. Errors are printed as
one line; `--debug` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

from lapse.cli import logs
from lapse.cli.logs import LOG_FORMAT_ENV, LOG_FORMATS
from lapse.cli.parsing import (
    EXIT_USAGE,
    GLOBAL_VALUE_FLAGS,
    HelpFormatter,
    LapseParser,
    global_options,
)

# Commands that run until stopped: their log keeps every NATS and HTTP retry (there they
# tell that a server went away) and the warning about a NATS without authentication.
LONG_RUNNING = ("up", "serve", "bridge")

EXIT_OK = 0
EXIT_FAILURE = 1

KUBE_CONFIG_HELP = (
    "Kubernetes configuration: {reason} (set --kubeconfig and --context, $KUBECONFIG, or "
    "kubernetes.kubeconfig / LAPSE_KUBERNETES__KUBECONFIG; kubernetes.in_cluster in a pod; "
    "`lapse up` starts a local cluster when none is configured)"
)

Command = Callable[[argparse.Namespace], int]

# Every command, its module and its one-line help. A command's module (and what it
# imports: the Kubernetes client, NATS, SQLAlchemy, rich; ~2 s) is imported only when that
# command runs or is completed, so `lapse --help` and completing a command name are quick.
# `register` in each module must use the same help text (tests/cli/test_habits.py).
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("lapse.cli.up", "run the whole pipeline (the main job)"),
    "demo": ("lapse.cli.demo", "a self-contained tour: watch lapse delete sample runs on time"),
    "plan": (
        "lapse.cli.plan",
        "preview deadlines of finished runs and orphaned rows (read-only)",
    ),
    "reconcile": (
        "lapse.cli.reconcile",
        "re-derive schedules from the runs and rows that exist (backfill, safety net)",
    ),
    "history": ("lapse.cli.history", "the audit trail: what was deleted, when, why"),
    "status": (
        "lapse.cli.status",
        "pending schedules, next deadlines, dead letters, recent outcomes",
    ),
    "dlq": ("lapse.cli.dlq", "dead letters: list, show, replay, purge"),
    "brake": ("lapse.cli.brake", "the mass-deletion brake: is it engaged, release it"),
    "serve": ("lapse.cli.serve", "serve one function over HTTP, as Knative would"),
    "bridge": (
        "lapse.cli.bridge",
        "deliver due events and cleanup outcomes from NATS to an HTTP sink (Knative Broker)",
    ),
    "infra": ("lapse.cli.infra", "manage what lapse needs in NATS"),
    "fleet": ("lapse.cli.fleet", "the fleet's hub: its NATS configuration and streams"),
    "completion": ("lapse.cli.completion", "print a shell completion script (bash, zsh, fish)"),
    "version": ("lapse.cli.version", "the client's version, and the running lapse up's"),
}


class _Version(argparse.Action):
    """`--version`, reading the package metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import version

        print(f"lapse {version('lapse')}")
        parser.exit()


def command_in(words: Sequence[str]) -> str | None:
    """The command a command line names: the first word that is not a global flag or its
    value; None when there is none (or it is not a command: argparse says so)."""
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in GLOBAL_VALUE_FLAGS:
            skip = True
            continue
        if word.startswith("-"):
            continue
        return word if word in COMMANDS else None
    return None


def build_parser(only: str | None = None, *, full: bool = True) -> LapseParser:
    """The parser; with `full=False` only the command `only` is built whole, the others
    are a name and a help line (enough for `lapse --help` and completing command names)."""
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
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if full or name == only:
            _module(module).register(subparsers)
        else:
            subparsers.add_parser(name, help=help_text, description=help_text)
    return parser


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _completing() -> list[str] | None:
    """The words before the cursor when a shell asks argcomplete for completions."""
    if "_ARGCOMPLETE" not in os.environ:
        return None
    line = os.environ.get("COMP_LINE", "")
    point = int(os.environ.get("COMP_POINT", len(line)))
    return line[:point].split()[1:]


def main(argv: list[str] | None = None) -> int:
    completing = _completing()
    if completing is not None:
        import argcomplete

        from lapse.cli.completion import parser_for_completion

        # Exits the process with the candidates.
        argcomplete.autocomplete(parser_for_completion(completing))
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_in(words), full=False)
    args = parser.parse_args(argv)
    if args.log_format not in LOG_FORMATS:  # from $LAPSE_LOG_FORMAT, unchecked by argparse
        parser.error(f"{LOG_FORMAT_ENV}={args.log_format}: not one of {', '.join(LOG_FORMATS)}")
    logs.configure(args.log_format, debug=args.debug)
    from lapse.config.redact import RedactingFilter  # after parsing: --help stays light

    for handler in logging.getLogger().handlers:
        # Whatever logs a URL (lapse, nats-py, SQLAlchemy with --debug), never its secret.
        handler.addFilter(RedactingFilter())
    if args.command not in LONG_RUNNING and not args.debug:
        # nats-py, lapse's NATS edge and urllib3 log each failed connection attempt (nats-py with a
        # traceback); a command's own one-line error says what matters. `lapse up` keeps
        # them: there they tell that a server went away.
        # On the handlers: the Kubernetes client resets the urllib3 logger's level.
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_retries)
    elif not args.debug:
        # urllib3's "Retrying (Retry(total=1, ...)) after connection broken by
        # 'NewConnectionError(...)'" repeats, raw, what the watcher and the reapers then
        # say in one line ("the connection to the server 127.0.0.1:6443 was refused").
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_urllib3_retries)
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE if args.command is None and argv else EXIT_OK
    try:
        code = run(args)
        sys.stdout.flush()  # a reader that left (`| head`) is found here, not at exit
        return code
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except Exception as exc:
        message, code = _describe(exc)
        return _fail(args, message, code)


def _quiet_broken_pipe() -> int:
    """`lapse plan -o yaml | head`: the reader left, as kubectl takes it: no message. Python
    would complain again when flushing stdout at exit, so stdout goes to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_OK


def _describe(exc: Exception) -> tuple[str, int]:
    """The one line and exit code for an error. Classes are looked up only in modules the
    command imported: an exception cannot be of a class that was never loaded."""
    usage: list[type[BaseException]] = []
    for module, names in (
        ("lapse.cli.common", ("UsageError",)),
        ("lapse.config", ("ConfigError",)),
        ("lapse.runtime.resources", ("MissingSetting",)),
        ("lapse.telemetry", ("TelemetryError",)),
        ("lapse.embedded.nats", ("MissingExtra",)),
    ):
        if (loaded := sys.modules.get(module)) is not None:
            usage += [getattr(loaded, name) for name in names if hasattr(loaded, name)]
    if usage and isinstance(exc, tuple(usage)):
        return str(exc), EXIT_USAGE
    exceptions = sys.modules.get("kubernetes.config.config_exception")
    if exceptions is not None and isinstance(exc, exceptions.ConfigException):
        # The Kubernetes client's "Invalid kube-config file. No configuration found." (or
        # an unknown context): a configuration problem, so it says what to set.
        reason = " ".join(str(exc).split())
        missing = _missing_kubeconfig_env()
        if missing is not None:  # name the path the user set, not the client's guess
            reason = f"$KUBECONFIG {missing}: file not found"
        return KUBE_CONFIG_HELP.format(reason=reason), EXIT_USAGE
    kube_errors = sys.modules.get("kubernetes.client.exceptions")
    urllib3 = sys.modules.get("urllib3")
    if (kube_errors is not None and isinstance(exc, kube_errors.ApiException)) or (
        urllib3 is not None and isinstance(exc, urllib3.exceptions.HTTPError)
    ):
        from lapse.edges.kubernetes.client import describe_api_error

        # "the connection to the server 127.0.0.1:6443 was refused", a 429 as one line:
        # not urllib3's nested repr, not the client's dump of HTTP headers.
        return describe_api_error(exc), EXIT_FAILURE
    return str(exc) or type(exc).__name__, EXIT_FAILURE


# Loggers that report each failed connection attempt (nats-py, lapse's NATS edge, urllib3).
_RETRY_LOGGERS = ("nats.", "lapse.edges.nats", "urllib3.")


def _quiet_retries(record: logging.LogRecord) -> bool:
    return not record.name.startswith(_RETRY_LOGGERS) or record.levelno >= logging.CRITICAL


def _quiet_urllib3_retries(record: logging.LogRecord) -> bool:
    return not (record.name.startswith("urllib3.") and str(record.msg).startswith("Retrying"))


def _missing_kubeconfig_env() -> str | None:
    value = os.environ.get("KUBECONFIG")
    if not value:
        return None
    paths = [p for p in value.split(os.pathsep) if p]
    return value if not any(os.path.isfile(os.path.expanduser(p)) for p in paths) else None


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    from lapse.config.redact import redact

    if args.debug:
        print(redact(traceback.format_exc()), end="", file=sys.stderr)
    print(f"lapse: {redact(' '.join(message.split()))}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
