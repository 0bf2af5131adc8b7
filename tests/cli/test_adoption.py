"""Habits a first-week user runs into (issue 24): typos get a suggestion, `| head` is
quiet, flags that would be ignored are refused, `lapse version` finds `lapse up`."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest
import yaml

from lapse.cli.main import COMMANDS, build_parser, command_in
from lapse.embedded.process import free_port
from tests.cli.conftest import LAPSE, Shell
from tests.conftest import KubeStack


def _closed_early(shell: Shell, *args: str) -> subprocess.CompletedProcess[str]:
    """Run lapse with a stdout whose reader is already gone (`| head` that finished)."""
    process = subprocess.Popen(
        [*LAPSE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=shell.env,
        cwd=shell.home,
    )
    assert process.stdout is not None
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(args, process.returncode, "", err)


def test_a_reader_that_left_is_not_an_error(shell: Shell) -> None:
    result = _closed_early(shell, "completion", "bash")
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.kube
def test_plan_into_a_closed_pipe_is_quiet(shell: Shell, kube: KubeStack) -> None:
    kube.namespace("adoption-pipe")
    result = _closed_early(shell, "plan", "--kubeconfig", str(kube.kubeconfig), "-o", "yaml")
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["stauts"], "did you mean 'status'?"),
        (["history", "--outcome", "delted"], "did you mean 'deleted'?"),
        (["history", "--target", "databse"], "did you mean 'database'?"),
        (["history", "--kind", "Workflw"], "did you mean 'Workflow'?"),
        (["status", "--kind", "pipelinerunz"], "did you mean 'pipelineruns'?"),
        (["plan", "--kind", "jbo"], "did you mean 'job'?"),
    ],
)
def test_a_typo_is_a_usage_error_with_a_suggestion(
    shell: Shell, args: list[str], suggestion: str
) -> None:
    result = shell(*args)
    assert result.returncode == 2, result.stderr
    assert suggestion in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_an_outcome_is_case_insensitive(shell: Shell) -> None:
    # Parsed, then it fails for want of a NATS server, not for the outcome.
    result = shell("history", "--outcome", "DELETED")
    assert result.returncode == 2
    assert "nats.url is not set" in result.stderr


def test_switches_do_not_show_a_misleading_default(shell: Shell) -> None:
    text = " ".join(shell("up", "--help").stdout.split())
    assert "--no-watch" in text
    assert "(default: True)" not in text and "(default: False)" not in text


def test_status_takes_A_like_kubectl(shell: Shell) -> None:
    result = shell("status", "-A")
    assert result.returncode == 2
    assert "nats.url is not set" in result.stderr


@pytest.mark.parametrize("flag", ["--kubeconfig", "--context", "--nats-url"])
def test_demo_refuses_flags_it_would_ignore(shell: Shell, tmp_path: Path, flag: str) -> None:
    result = shell("demo", flag, str(tmp_path / "x"))
    assert result.returncode == 2
    assert f"{flag} would be ignored" in result.stderr


def test_a_bad_log_format_in_the_environment_is_a_usage_error(shell: Shell) -> None:
    result = shell("status", env={"LAPSE_LOG_FORMAT": "xml"})
    assert result.returncode == 2
    assert "LAPSE_LOG_FORMAT=xml" in result.stderr


def test_version_without_a_running_up(shell: Shell) -> None:
    result = shell("version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Client Version: 0.")
    assert lines[1] == f"lapse up: not running with state directory {shell.state_dir}"


def test_the_quick_help_is_the_commands_own() -> None:
    # `lapse --help` lists each command from COMMANDS without importing it; the text must
    # be what the command registers.
    full = build_parser()
    subparsers = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert helps == {name: text for name, (_, text) in COMMANDS.items()}


def test_the_command_is_found_past_global_flags() -> None:
    assert command_in(["--config", "x.yaml", "--debug", "plan", "-A"]) == "plan"
    assert command_in(["--kubeconfig", "status", "history"]) == "history"
    assert command_in(["--help"]) is None
    assert command_in(["nope"]) is None


def test_an_api_server_that_refuses_is_one_line_like_kubectl(shell: Shell) -> None:
    port = free_port()  # nothing listens there
    kubeconfig = shell.home / "refused.kubeconfig"
    cluster = {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    result = shell("plan", "--kubeconfig", str(kubeconfig))
    assert result.returncode == 1
    assert result.stderr == (
        f"lapse: the connection to the server 127.0.0.1:{port} was refused - "
        "did you specify the right host or port?\n"
    )
