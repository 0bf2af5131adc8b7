"""The parser every command shares: global flags accepted before or after the command,
one-line usage errors, and help that shows each option's default.

Global flags are added twice: to the top-level parser with their real defaults, and to
each command with `SUPPRESS` as default, so a flag given after the command overrides the
one before it and an absent one leaves it alone.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from lapse.cli.logs import LOG_FORMATS, default_log_format

EXIT_USAGE = 2


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless the default says nothing (None, off)
    or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "(default:" in text
            # A switch's default is the opposite of giving it: "--no-watch (default: True)"
            # read as if --no-watch were on.
            or isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
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


# The global flags that take a value (the word after them is not a command).
GLOBAL_VALUE_FLAGS = frozenset(
    ("--config", "--kubeconfig", "--context", "--nats-url", "--log-format", "--state-dir")
)

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)")


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """ "; did you mean 'status'?" when one choice is close to what was typed, else ""."""
    close = difflib.get_close_matches(given, list(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[given.lower()]] if given.lower() in lowered else []
    return f"; did you mean '{close[0]}'?" if close else ""


def offer(action: argparse.Action, values: Iterable[str]) -> argparse.Action:
    """Completion offers `values` for `action` (a flag whose values argparse does not check
    with `choices`: a closed set checked case-insensitively, an open one with known values);
    lapse/cli/completion.py reads them."""
    action.offered = tuple(values)  # type: ignore[attr-defined]
    return action


def offered(action: argparse.Action) -> tuple[str, ...] | None:
    """What completion offers for `action`, when `offer` or `closed_set` said."""
    found = getattr(action, "offered", None) or getattr(action.type, "values", None)
    return tuple(found) if found is not None else None


def closed_set(name: str, values: Iterable[str]) -> Callable[[str], str]:
    """An argparse `type` for a flag taking one of `values` (case-insensitive): a typo is
    a usage error with a suggestion, not an empty answer."""
    allowed = tuple(values)

    def check(text: str) -> str:
        for value in allowed:
            if text.lower() == value.lower():
                return value
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {name} (one of {', '.join(allowed)}){did_you_mean(text, allowed)}"
        )

    check.values = allowed  # type: ignore[attr-defined]  # completion offers them (offered)
    return check


class LapseParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other lapse error; the usage is one --help away. A mistyped
        # command or choice gets the nearest one, as kubectl and git suggest.
        if match := _INVALID_CHOICE.search(message):
            choices = re.findall(r"'([^']*)'", match["choices"])
            message += did_you_mean(match["given"], choices)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction[LapseParser]:  # type: ignore[override]
        kwargs.setdefault("action", Commands)
        subparsers: argparse._SubParsersAction[LapseParser] = super().add_subparsers(**kwargs)
        return subparsers


def global_options(*, after_command: bool) -> argparse.ArgumentParser:
    """`--config --debug --kubeconfig --context --nats-url --log-format --state-dir`."""
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
        help="kubeconfig file (default: kubernetes.kubeconfig; else the cluster a running "
        "`lapse up` started; else, for the read-only commands, $KUBECONFIG or "
        "~/.kube/config. `lapse up` and `lapse reconcile` never use $KUBECONFIG or "
        "~/.kube/config unasked)",
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
        "--log-format",
        choices=LOG_FORMATS,
        default=default(default_log_format()),
        help="log lines as text or as one JSON object a line (default: $LAPSE_LOG_FORMAT, "
        "else text)",
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
