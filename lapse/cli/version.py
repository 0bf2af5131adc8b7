"""`lapse version`: the client's version and, when one runs with this state directory, the
version of `lapse up` (it writes `up.version` there), as `kubectl version` shows both."""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version

from lapse.cli import state
from lapse.cli.common import state_dir_of


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "version",
        help="the client's version, and the running lapse up's",
        description=(
            "Print this lapse's version and, when a `lapse up` runs with the same state "
            "directory (--state-dir), its version and process id."
        ),
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("text", "json"),
        default="text",
        help="output format",
    )
    parser.set_defaults(run=run_version)


def running_up(args: argparse.Namespace) -> dict[str, object] | None:
    found = state.running_up(state_dir_of(args))
    if found is None:
        return None
    up_version, pid, path = found
    return {"version": up_version, "pid": pid, "stateFile": str(path)}


def run_version(args: argparse.Namespace) -> int:
    client = version("lapse")
    up = running_up(args)
    if args.output == "json":
        print(json.dumps({"clientVersion": client, "up": up}, indent=2))
        return 0
    print(f"Client Version: {client}")
    if up is None:
        print(f"lapse up: not running with state directory {state_dir_of(args)}")
    else:
        print(f"lapse up Version: {up['version']} (pid {up['pid']}, {up['stateFile']})")
    return 0
