"""`lapse plan` and `lapse infra apply`, run as a user runs them, against real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from lapse.edges.nats import connect
from lapse.embedded.nats import EmbeddedNats
from tests.conftest import KubeStack


def lapse(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lapse.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def finished_workflow(name: str, phase: str, finished_at: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {
                "workflows.argoproj.io/completed": "true",
                "workflows.argoproj.io/phase": phase,
                **meta.get("labels", {}),
            },
            "annotations": meta.get("annotations", {}),
        },
        "spec": {"entrypoint": "main", "templates": [{"name": "main"}], **meta.get("spec", {})},
        "status": {"phase": phase, "startedAt": "2026-11-20T09:00:00Z", "finishedAt": finished_at},
    }


async def test_plan_prints_each_targets_deadline_and_rule(kube: KubeStack, tmp_path: Path) -> None:
    ns = kube.namespace(f"plan-{uuid.uuid4().hex[:6]}")
    wfs = kube.workflows
    await wfs.create(
        ns,
        finished_workflow(
            "ttl-annotated",
            "Succeeded",
            "2026-11-20T10:00:00Z",
            annotations={"lapse.dev/ttl": "90m"},
        ),
    )
    await wfs.create(
        ns,
        finished_workflow(
            "argo-failed",
            "Failed",
            "2026-11-20T10:00:00Z",
            spec={"ttlStrategy": {"secondsAfterCompletion": 600, "secondsAfterFailure": 60}},
        ),
    )
    await wfs.create(
        ns,
        finished_workflow(
            "argo-error",
            "Error",
            "2026-11-20T10:00:00Z",
            spec={"ttlStrategy": {"secondsAfterCompletion": 600, "secondsAfterFailure": 60}},
        ),
    )
    await wfs.create(
        ns,
        finished_workflow(
            "kept", "Succeeded", "2026-11-20T10:00:00Z", annotations={"lapse.dev/keep": "true"}
        ),
    )
    kfp = finished_workflow(
        "kfp-run", "Succeeded", "2026-11-20T10:00:00Z", labels={"pipeline/runid": "8d3c7f0e-kfp"}
    )
    await wfs.create(ns, kfp)
    running = finished_workflow("still-running", "Running", "2026-11-20T10:00:00Z")
    running["metadata"]["labels"]["workflows.argoproj.io/completed"] = "false"
    await wfs.create(ns, running)

    config = tmp_path / "lapse.yaml"
    config.write_text(
        "policies:\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 1h}\n"
        "    database: {ttl: 30d}\n"
    )
    env = {"LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)}
    result = lapse("--config", str(config), "plan", "-n", ns, "-o", "json", env=env)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["items"]}
    assert set(rows) == {"ttl-annotated", "argo-failed", "argo-error", "kept", "kfp-run"}

    def target(name: str, t: str) -> tuple[str, str | None, str]:
        d = rows[name]["targets"][t]
        return d["action"], d["deadline"], d["policy"]

    assert target("ttl-annotated", "kubernetes") == (
        "schedule",
        "2026-11-20T11:30:00Z",
        "annotation:lapse.dev/ttl",
    )
    assert target("argo-failed", "kubernetes") == (
        "schedule",
        "2026-11-20T10:01:00Z",
        "argo:ttlStrategy.secondsAfterFailure",
    )
    assert target("argo-error", "kubernetes") == (
        "schedule",
        "2026-11-20T10:10:00Z",
        "argo:ttlStrategy.secondsAfterCompletion",
    )
    assert target("kept", "kubernetes")[0] == "cancel"
    assert target("kfp-run", "kubernetes") == (
        "schedule",
        "2026-11-20T11:00:00Z",
        "policy:kfp-runs",
    )
    assert target("kfp-run", "database") == ("schedule", "2026-12-20T10:00:00Z", "policy:kfp-runs")
    assert target("ttl-annotated", "database") == ("cancel", None, "default")
    assert rows["kfp-run"]["kfpRunId"] == "8d3c7f0e-kfp"

    table = lapse("--config", str(config), "plan", "-n", ns, env=env)
    assert table.returncode == 0, table.stderr
    assert len(table.stdout.splitlines()) == 1 + 5  # the header and one line per run
    assert "policy:kfp-runs" in table.stdout


def test_plan_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "lapse.yaml"
    config.write_text("policies:\n  - name: p\n    kubernetes: {ttl: 3x}\n")
    result = lapse("--config", str(config), "plan")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "policies[0].kubernetes.ttl" in result.stderr


async def test_infra_apply_is_idempotent(nats_server: EmbeddedNats) -> None:
    env = {
        "LAPSE_NATS__URL": nats_server.url,
        # Own names: other tests in this session use the default streams.
        "LAPSE_NATS__STREAMS__SCHEDULE": "CLI_SCHED",
        "LAPSE_NATS__STREAMS__EVENTS": "CLI_EVENTS",
        "LAPSE_NATS__STREAMS__AUDIT": "CLI_AUDIT",
        "LAPSE_NATS__STREAMS__DLQ": "CLI_DLQ",
    }
    first = lapse("infra", "apply", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split("\n")[:4] == [
        "created CLI_SCHED",
        "created CLI_EVENTS",
        "created CLI_AUDIT",
        "created CLI_DLQ",
    ]
    second = lapse("infra", "apply", env=env)
    assert second.returncode == 0, second.stderr
    assert "updated CLI_SCHED" in second.stdout
    # Leave nothing behind that could overlap other tests' streams.
    nc = await connect(nats_server.url)
    for name in ("CLI_SCHED", "CLI_EVENTS", "CLI_AUDIT", "CLI_DLQ"):
        await nc.jetstream().delete_stream(name)
    await nc.close()
