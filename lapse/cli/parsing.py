"""The parser every command shares: global flags accepted before or after the command,
one-line usage errors, and help that shows each option's default.

Global flags are added twice: to the top-level parser with their real defaults, and to
each command with `SUPPRESS` as default, so a flag given after the command overrides the
one before it and an absent one leaves it alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

EXIT_USAGE = 2


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless the default says nothing (None, off)
    or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


class Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Every command (and sub-command) gets the global flags and the shared formatter."""

    def add_parser(self, name: str, **kwargs: Any) -> LapseParser:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs["parents"] = [*kwargs.get("parents", ()), global_options(after_command=True)]
        parser: LapseParser = super().add_parser(name, **kwargs)
        return parser


class LapseParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other lapse error; the usage is one --help away.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction[LapseParser]:  # type: ignore[override]
        kwargs.setdefault("action", Commands)
        subparsers: argparse._SubParsersAction[LapseParser] = super().add_subparsers(**kwargs)
        return subparsers


def global_options(*, after_command: bool) -> argparse.ArgumentParser:
    """`--config --debug --kubeconfig --context --nats-url --state-dir`."""
    parser = argparse.ArgumentParser(add_help=False)

    def default(value: object) -> object:
        return argparse.SUPPRESS if after_command else value

    parser.add_argument(
        "--config",
        metavar="FILE",
        default=default(None),
        help="configuration file (default: $LAPSE_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="verbose logs and full tracebacks",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="FILE",
        type=Path,
        default=default(None),
        help="kubeconfig file (default: kubernetes.kubeconfig, $KUBECONFIG, ~/.kube/config, "
        "or the cluster `lapse up` started)",
    )
    parser.add_argument(
        "--context",
        default=default(None),
        help="kubeconfig context (default: kubernetes.context, else the current context)",
    )
    parser.add_argument(
        "--nats-url",
        metavar="URL",
        default=default(None),
        help="NATS server (default: nats.url, else the server `lapse up` started)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        type=Path,
        default=default(None),
        help="where `lapse up` keeps its embedded servers and the URLs other commands "
        "read (default: $XDG_STATE_HOME/lapse or ~/.local/state/lapse)",
    )
    return parser
