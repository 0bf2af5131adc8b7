"""`lapse.example.yaml` is a starting file: copied as it is, every command runs with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli.conftest import Shell
from tests.conftest import KubeStack

EXAMPLE = Path(__file__).resolve().parents[2] / "lapse.example.yaml"


@pytest.mark.kube
def test_a_copy_of_the_example_runs_plan(shell: Shell, kube: KubeStack) -> None:
    shutil.copy(EXAMPLE, shell.home / "lapse.yaml")
    result = shell(
        "--config", "lapse.yaml", "plan", "--kubeconfig", str(kube.kubeconfig), "-o", "json"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "List"
    # No example path of a file that only exists on someone's server is read.
    assert "/etc/lapse" not in result.stderr


def test_a_copy_of_the_example_names_its_configuration_keys_only(shell: Shell) -> None:
    # Without a cluster it fails the way an empty configuration does: no example file is
    # read on the way (a NATS password file, a kubeconfig).
    shutil.copy(EXAMPLE, shell.home / "lapse.yaml")
    result = shell("--config", "lapse.yaml", "plan")
    assert result.returncode == 2
    assert "/etc/lapse" not in result.stderr
    assert "--kubeconfig" in result.stderr
