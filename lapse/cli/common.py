"""What every command does first: load the configuration, open the resources."""

from __future__ import annotations

import argparse

from lapse.config import ConfigError, LapseConfig, load_config
from lapse.errors import LapseError


class UsageError(LapseError):
    """The command line or the configuration is wrong: exit code 2."""


def config_from(args: argparse.Namespace) -> LapseConfig:
    try:
        return load_config(getattr(args, "config", None))
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def add_nats_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="NATS server (default: nats.url from the config)")
