"""The `lapse` command line: `main` parses, runs one command and maps errors to exit codes;
one module per sub-command, each exposing `register(subparsers)`."""

from lapse.cli.main import main

__all__ = ["main"]
