"""`lapse completion SHELL`: a completion script for bash, zsh or fish (argcomplete).

The script asks lapse itself for the candidates (argcomplete runs the parser in a special
mode), so completions follow the commands and flags of the installed version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from lapse.cli.parsing import offered

SHELLS = ("bash", "zsh", "fish")

INSTALL = {
    "bash": "source <(lapse completion bash)   # in ~/.bashrc",
    "zsh": "source <(lapse completion zsh)    # in ~/.zshrc",
    "fish": "lapse completion fish > ~/.config/fish/completions/lapse.fish",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh, fish)",
        description="Print a completion script for SHELL. Install it with:\n  "
        + "\n  ".join(INSTALL.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(run=run_completion)


def run_completion(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["lapse"], shell=args.shell))
    return 0


# Completing inside a command (`lapse plan --<TAB>`) needs that command's parser, and
# building it imports the command's module and all it imports (the Kubernetes client,
# SQLAlchemy, NATS, rich: seconds, at every TAB). So the first completion of a command
# saves the shape of its parser (flags, how many values each takes, choices, help lines,
# sub-commands; no code, no defaults) in the user's cache, and later ones rebuild the parser
# from it without importing the command. The cache is keyed by the code that makes the
# parsers (name, size and mtime of every module of the `lapse` package), so a new version
# or an edit in a checkout is never answered from a stale one. A parser whose arguments
# have argcomplete completers of their own (code) is not cached.

_CACHE_FORMAT = "2"  # part of the key: bump it when the shape's layout changes


def parser_for_completion(words: list[str]) -> argparse.ArgumentParser:
    """The parser argcomplete completes `words` with: the command's shape from the cache
    when there is one, else the command's real parser (and its shape saved)."""
    from lapse.cli.main import build_parser, command_in

    command = command_in(words)
    if command is None:
        return build_parser(None, full=False)
    cache = _cache_file()
    shapes = _read(cache)
    shape = shapes.get(command)
    if shape is not None:
        parser = build_parser(None, full=False)  # every command a name only
        commands = _subparsers(parser)
        commands.choices[command] = _rebuild(shape, commands.choices[command].prog)
        return parser
    parser = build_parser(command, full=False)
    shape = _shape(_subparsers(parser).choices[command])
    if shape is None:
        return parser
    _write(cache, {**shapes, command: shape})
    # Completed from the shape, as later completions are: the values it offers as choices.
    commands = _subparsers(parser)
    commands.choices[command] = _rebuild(shape, commands.choices[command].prog)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _shape(parser: argparse.ArgumentParser) -> dict[str, Any] | None:
    actions: list[dict[str, Any]] = []
    groups = [
        [parser._actions.index(a) for a in group._group_actions]
        for group in parser._mutually_exclusive_groups
    ]
    for action in parser._actions:
        if getattr(action, "completer", None) is not None:
            return None
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            subcommands = {}
            for name, sub in action.choices.items():
                sub_shape = _shape(sub)
                if sub_shape is None:
                    return None
                subcommands[name] = {"help": helps.get(name), "shape": sub_shape}
            actions.append({"dest": action.dest, "subcommands": subcommands})
            continue
        # A closed set checked by `type` (`--outcome`), or known values (`--kind`, `-o`):
        # offered as choices, never file names.
        values = action.choices if action.choices is not None else offered(action)
        choices = None if values is None else [str(c) for c in values]
        metavar = list(action.metavar) if isinstance(action.metavar, tuple) else action.metavar
        actions.append(
            {
                "options": list(action.option_strings),
                "dest": action.dest,
                "nargs": action.nargs,
                "choices": choices,
                "help": action.help,
                "metavar": metavar,
                "required": action.required,
                "kind": "help" if isinstance(action, argparse._HelpAction) else None,
            }
        )
    return {"actions": actions, "groups": groups}


def _rebuild(shape: dict[str, Any], prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    group_of: dict[int, Any] = {}
    for indexes in shape["groups"]:
        group = parser.add_mutually_exclusive_group()
        group_of.update((index, group) for index in indexes)
    for index, action in enumerate(shape["actions"]):
        if "subcommands" in action:
            subparsers = parser.add_subparsers(dest=action["dest"])
            for name, sub in action["subcommands"].items():
                subparsers.add_parser(name, help=sub["help"], add_help=False)
                subparsers.choices[name] = _rebuild(sub["shape"], f"{prog} {name}")
            continue
        target = group_of.get(index, parser)
        options, kwargs = action["options"], {"help": action["help"]}
        if action["kind"] == "help":
            target.add_argument(*options, action="help", **kwargs)
            continue
        if action["nargs"] == 0:
            kwargs.update(action="store_const", const=None, required=action["required"])
        else:
            metavar = action["metavar"]
            kwargs.update(
                nargs=action["nargs"],
                choices=action["choices"],
                metavar=tuple(metavar) if isinstance(metavar, list) else metavar,
            )
            if options:
                kwargs["required"] = action["required"]
        if options:
            target.add_argument(*options, dest=action["dest"], **kwargs)
        else:
            target.add_argument(action["dest"], **kwargs)
    return parser


def _cache_file() -> Path:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{_CACHE_FORMAT}\0{package}\0".encode())
    for directory, folders, files in os.walk(package, followlinks=True):
        # Function folders' generated copies of lapse (make functions) are not its code.
        folders[:] = sorted(f for f in folders if f not in ("__pycache__", "vendor", "lib"))
        for name in sorted(files):
            if name.endswith(".py"):
                found = os.stat(os.path.join(directory, name))
                digest.update(
                    f"{directory}/{name}\0{found.st_size}\0{found.st_mtime_ns}\0".encode()
                )
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lapse" / "completion" / f"{digest.hexdigest()[:16]}.json"


def _read(cache: Path) -> dict[str, Any]:
    try:
        shapes = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return shapes if isinstance(shapes, dict) else {}


def _write(cache: Path, shapes: dict[str, Any]) -> None:
    """Atomically (another shell may complete at the same time); older keys' files go.
    A cache that cannot be written only means the next completion is slow too."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        for stale in cache.parent.glob("*.json"):
            if stale != cache:
                stale.unlink(missing_ok=True)
        temporary = cache.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(shapes))
        os.replace(temporary, cache)
    except OSError:
        pass
