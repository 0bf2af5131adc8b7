"""`lapse completion SHELL`: a completion script for bash, zsh or fish (argcomplete).

The script asks lapse itself for the candidates (argcomplete runs the parser in a special
mode), so completions follow the commands and flags of the installed version.
"""

from __future__ import annotations

import argparse
import sys

from argcomplete.shell_integration import shellcode

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
    sys.stdout.write(shellcode(["lapse"], shell=args.shell))
    return 0
