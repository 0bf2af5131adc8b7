"""Habits that need no server: help, versions, usage errors, global flags in either
position, exit codes, completion."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from lapse.cli.main import build_parser
from tests.cli.conftest import Shell

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    "up",
    "demo",
    "plan",
    "reconcile",
    "history",
    "status",
    "dlq",
    "serve",
    "bridge",
    "infra",
]


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_option_of_every_command_has_help() -> None:
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_defaults_and_the_global_flags(shell: Shell, command: str) -> None:
    result = shell(command, "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--config", "--kubeconfig", "--context", "--nats-url", "--debug"):
        assert flag in result.stdout, (command, flag)
    if command in ("plan", "history", "status", "reconcile"):
        assert "(default: table)" in " ".join(result.stdout.split())


def test_status_recent_shows_its_default(shell: Shell) -> None:
    text = " ".join(shell("status", "--help").stdout.split())
    assert re.search(r"--recent N how many recent outcomes to show \(default: 10\)", text)


def test_version_is_the_packages(shell: Shell) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = shell("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"lapse {declared}"


def test_a_usage_error_is_one_line_and_exit_2(shell: Shell) -> None:
    result = shell("plan", "-o", "xml")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "'xml' is not an output format (one of table, wide, json" in result.stderr
    assert "did you mean 'json'?" in shell("plan", "-o", "jsonn").stderr
    assert "lapse plan --help" in result.stderr


def test_n_and_A_cannot_be_combined(shell: Shell) -> None:
    result = shell("history", "-n", "a", "-A")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_global_flags_work_before_and_after_the_command(
    shell: Shell, tmp_path: Path, before: bool
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nats: {replicas: 9}\n")
    args = ["--config", str(bad), "status"] if before else ["status", "--config", str(bad)]
    result = shell(*args)
    assert result.returncode == 2
    assert "nats.replicas" in result.stderr
    assert result.stderr.count("\n") == 1


def test_the_flag_after_the_command_wins(shell: Shell, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nats: {replicas: 9}\n")
    good = tmp_path / "good.yaml"
    good.write_text("nats: {replicas: 1}\n")
    # With the good file last, the configuration loads and status fails later, for want
    # of a NATS server: a different error, naming what to set.
    result = shell("--config", str(bad), "status", "--config", str(good))
    assert result.returncode == 2
    assert "nats.url is not set" in result.stderr


def test_no_kubeconfig_is_a_configuration_error_naming_what_to_set(shell: Shell) -> None:
    result = shell("plan")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--kubeconfig" in result.stderr
    assert "LAPSE_KUBERNETES__KUBECONFIG" in result.stderr


def test_a_missing_kubeconfig_file_is_exit_2(shell: Shell, tmp_path: Path) -> None:
    result = shell("plan", "--kubeconfig", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "--kubeconfig" in result.stderr and "file not found" in result.stderr


def test_an_unreachable_server_is_a_runtime_failure(shell: Shell) -> None:
    # Port 1 on loopback: nothing listens there.
    result = shell("status", "--nats-url", "nats://127.0.0.1:1", timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("lapse: ")
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    ("shell_name", "marker"),
    [("bash", "complete "), ("zsh", "compdef"), ("fish", "complete --command lapse")],
)
def test_completion_scripts_generate(shell: Shell, shell_name: str, marker: str) -> None:
    result = shell("completion", shell_name)
    assert result.returncode == 0, result.stderr
    assert marker in result.stdout
    assert "_ARGCOMPLETE" in result.stdout  # the script asks lapse for the candidates


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("lapse pl", {"plan"}),
        ("lapse history --out", {"--output"}),
        ("lapse status -o ", {"json", "yaml"}),
    ],
)
def test_completion_completes_commands_flags_and_values(
    shell: Shell, tmp_path: Path, line: str, expected: set[str]
) -> None:
    out = tmp_path / "candidates"
    result = shell(
        env={
            "_ARGCOMPLETE": "1",
            "_ARGCOMPLETE_SHELL": "bash",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_IFS": "\n",
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
        }
    )
    assert result.returncode == 0, result.stderr
    candidates = {c.strip() for c in out.read_text().split("\n") if c.strip()}
    assert expected <= candidates, candidates
