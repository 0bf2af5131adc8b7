"""The command line as users run it: `python -m lapse.cli ...` in a subprocess, with an
environment of its own (no LAPSE_* settings, no kubeconfig, a private state directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

LAPSE = [sys.executable, "-m", "lapse.cli"]


@dataclass
class Shell:
    """A user's shell: its environment, and `lapse` run in it."""

    env: dict[str, str]
    home: Path

    @property
    def state_dir(self) -> Path:
        return Path(self.env["XDG_STATE_HOME"]) / "lapse"

    def __call__(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LAPSE, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
            cwd=self.home,
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*LAPSE, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.home,
        )


@pytest.fixture
def shell(tmp_path: Path) -> Shell:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LAPSE_", "OTEL_")) and k != "KUBECONFIG"
    }
    # HOME too: ~/.kube/config and ~/.local/state must be this test's, not the machine's.
    env.update(HOME=str(home), XDG_STATE_HOME=str(tmp_path / "state"), COLUMNS="200")
    return Shell(env, home)


def items(result: subprocess.CompletedProcess[str]) -> list[Any]:
    """The items of a listing printed with `-o json`: a kubectl List (docs/cli.md)."""
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["apiVersion"] == "v1" and found["kind"] == "List", found
    listed: list[Any] = found["items"]
    return listed
