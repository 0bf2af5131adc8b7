"""`lapse reconcile` with the shared habits: -n exact, -l on the API server, global flags
after the command, report formats."""

from __future__ import annotations

import json
import uuid

import pytest
import yaml
from nats.js import JetStreamContext

from lapse.embedded.nats import EmbeddedNats
from tests.cli.conftest import Shell
from tests.conftest import KubeStack
from tests.integration.test_cli_plan_infra import finished_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]


async def test_reconcile_dry_run_counts_what_n_and_l_select(
    shell: Shell, kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    ns = kube.namespace(f"cli-rec-{uuid.uuid4().hex[:6]}")
    for i, team in enumerate(("red", "red", "blue")):
        wf = finished_workflow(
            f"wf-{i}", "Succeeded", "2026-11-20T10:00:00Z", labels={"team": team}
        )
        await kube.workflows.create(ns, wf)
    common = ["--kubeconfig", str(kube.kubeconfig), "--nats-url", nats_server.url]

    result = shell("reconcile", "--dry-run", "-n", ns, *common, "-o", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dryRun"] is True and report["namespace"] == ns
    assert report["runs"]["listed"] == 3

    selected = shell("reconcile", "--dry-run", "-n", ns, "-l", "team=red", *common, "-o", "yaml")
    assert selected.returncode == 0, selected.stderr
    assert yaml.safe_load(selected.stdout)["runs"]["listed"] == 2

    # Global flags before the command, the same result.
    before = shell(*common, "reconcile", "--dry-run", "-n", ns, "-o", "json")
    assert json.loads(before.stdout)["runs"] == report["runs"]
