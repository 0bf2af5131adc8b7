"""The tenant boundary of the artifacts target, through `lapse up` (a subprocess) on its
embedded API server, NATS and a real S3 server (SeaweedFS).

A tenant may create and patch the Workflows of its own namespace, status included (Argo's
Workflow CRD has no status subresource), so what a Workflow records in
`status.nodes[*].outputs.artifacts` and the labels it carries are the tenant's word. Each
finding of issue 36 is one of tenant A's Workflows here, beside its own output:

- `wf-dir`: the directory of another namespace's finished run (its artifacts kept 1 h),
  and a key that run records (old: the directory went whole, the "shared" key with it);
- `wf-ckpt`: the checkpoint directory of another namespace's Running run;
- `wf-team`: a two-part key, another namespace's whole prefix (old: it met
  `min_prefix_depth: 2` and went);
- `wf-tekton`: a key in the Tekton log store of lapse.example.yaml (engine_outputs on by
  default);
- `wf-label`: a `{label:team}` capture template, the label set to the other namespace.

Then inside one namespace: a finished run that shares a key with a Running run comes due
(old: only finished runs' captures were consulted, the key went).

Each ends with 0 objects of the other namespace (or of the Running run) deleted, the
attempt named in the run's outcome, and the tenant's own artifacts deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from tests.conftest import ARTIFACT_BUCKET, KubeStack, kube_stack
from tests.e2e.test_artifacts_up import workflow_with_outputs
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.integration.test_artifact_reaper import client, plant, present
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-tenants")) as stack:
        yield stack


def running_workflow(name: str, keys: list[str]) -> dict[str, Any]:
    """A Workflow still running, whose status records what its steps wrote so far."""
    body = workflow_with_outputs(name, keys)
    body["metadata"]["labels"] = {}
    body["status"]["phase"] = "Running"
    del body["status"]["finishedAt"]
    return body


def write_config(
    path: Path,
    nats: EmbeddedNats,
    kube: KubeStack,
    s3: EmbeddedSeaweedFS,
    argo: str,
    tekton: str,
    other: str,
) -> None:
    """Two stores as lapse.example.yaml has them (Argo's, and Tekton Results' logs with
    engine_outputs left on), in one bucket under this test's prefixes; the other
    namespace's artifacts are kept an hour."""
    store = f"endpoint: '{s3.endpoint}', region: {REGION}"
    path.write_text(
        f"nats: {{url: '{nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "policies:\n"
        "  - name: theirs\n"
        f"    match: {{namespaces: ['{other}']}}\n"
        "    kubernetes: {ttl: 1s}\n"
        "    artifacts: {ttl: 1h}\n"
        "  - name: clocks\n"
        "    kubernetes: {ttl: 1s}\n"
        "    artifacts: {ttl: 10s}\n"
        "safety: {max_deletions_per_second: 1000, namespaces: {include: ['*']}}\n"
        "artifacts:\n"
        "  stores:\n"
        f"    - {{name: argo, url: 's3://{ARTIFACT_BUCKET}/{argo}/', {store},\n"
        "       min_prefix_depth: 2,\n"
        "       capture: {argo-workflow: ['{label:team}/labelled/']}}\n"
        f"    - {{name: tekton-logs, url: 's3://{ARTIFACT_BUCKET}/{tekton}/', {store},\n"
        "       min_prefix_depth: 3,\n"
        "       capture: {tekton-pipelinerun: ['logs/{namespace}/{uid}/']}}\n"
    )


async def artifacts_outcomes(config: Path, namespace: str, count: int) -> dict[str, Any]:
    """The artifacts outcome of each of `count` runs of the namespace, by run name."""

    async def recorded() -> dict[str, Any]:
        rows = lapse_json("history", "-n", namespace, config=config)
        found = {r["name"]: r for r in rows if r["target"] == "artifacts"}
        return found if len(found) >= count else {}

    return await wait_for(recorded, timeout=60, interval=1.0)


async def test_a_tenant_deletes_nothing_of_another_namespace_whatever_its_status_names(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    tag = uuid.uuid4().hex[:6]
    argo, tekton = f"argo-{tag}", f"tekton-{tag}"
    ours = kube.namespace(f"ten-a-{tag}")
    theirs = kube.namespace(f"ten-b-{tag}")
    config = tmp_path / "lapse.yaml"
    write_config(config, own_nats, kube, seaweedfs, argo, tekton, theirs)
    s3 = client(seaweedfs)
    b = f"{argo}/{theirs}"
    their_done = [f"{b}/done/out.tgz", f"{b}/done/main.log"]
    their_ckpt = [f"{b}/train/ckpt/step-1", f"{b}/train/ckpt/step-2"]
    their_log = f"{tekton}/logs/{theirs}/{uuid.uuid4()}/"
    their_other = [f"{b}/labelled/x", f"{b}/other/keep.txt", f"{their_log}task.log"]
    theirs_all = {*their_done, *their_ckpt, *their_other}
    tenant: dict[str, list[str]] = {
        "wf-dir": [f"{b}/done", f"{b}/done/out.tgz"],
        "wf-ckpt": [f"{b}/train/ckpt"],
        "wf-team": [b],
        "wf-tekton": [their_log.rstrip("/")],
        "wf-label": [],
    }
    own = {name: f"{argo}/{ours}/{name}/out.tgz" for name in tenant}
    await plant(s3, *theirs_all, *own.values())

    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        # The other namespace: a finished run whose artifacts are kept an hour (its object
        # goes: only its capture says what it holds), and a Running run.
        await kube.workflows.create(theirs, workflow_with_outputs("done", their_done))
        await kube.workflows.create(theirs, running_workflow("train", [f"{b}/train/ckpt"]))

        async def planned() -> bool:
            names = {w["metadata"]["name"] for w in (await kube.workflows.list(theirs))["items"]}
            return names == {"train"}

        await wait_for(planned, timeout=60, interval=0.3)
        # The tenant's runs, each naming what is not its own beside its own output.
        for name, keys in tenant.items():
            body = workflow_with_outputs(name, [own[name], *keys])
            if name == "wf-label":
                body["metadata"]["labels"]["team"] = theirs
            await kube.workflows.create(ours, body)

        outcomes = await artifacts_outcomes(config, ours, len(tenant))
        # Nothing of the other namespace went; everything of the tenant's own did.
        assert theirs_all <= await present(s3), theirs_all - await present(s3)
        assert not set(own.values()) & await present(s3)
        for row in outcomes.values():
            assert row["outcome"] == "deleted", row
            assert row["objectsDeleted"] == 1, row
        # Every attempt is named in the outcome, with why it was kept.
        detail = {name: row["detail"] for name, row in outcomes.items()}
        assert f"'{b}/done' kept: outside the run's roots" in detail["wf-dir"]
        assert f"'{b}/done/out.tgz' kept: outside the run's roots" in detail["wf-dir"]
        assert f"'{b}/train/ckpt' kept: outside the run's roots" in detail["wf-ckpt"]
        assert f"'{b}' kept: outside the run's roots" in detail["wf-team"]
        assert f"'{their_log.rstrip('/')}' kept: outside the run's roots" in detail["wf-tekton"]
        assert f"'{b}/labelled/' kept: outside the run's roots" in detail["wf-label"]
        # The deprecated template was said at start-up.
        log = (tmp_path / "up.log").read_text()
        assert "{label:team}/labelled/' names a label or annotation (deprecated" in log
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


async def test_a_key_a_running_run_records_is_kept_when_a_finished_run_sharing_it_is_due(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    tag = uuid.uuid4().hex[:6]
    argo = f"argo-{tag}"
    ns = kube.namespace(f"ten-c-{tag}")
    config = tmp_path / "lapse.yaml"
    write_config(config, own_nats, kube, seaweedfs, argo, f"tekton-{tag}", "none")
    s3 = client(seaweedfs)
    # A cached model a Running run reads (its input) and another wrote; and a checkpoint
    # directory below a directory the finished run records.
    model = f"{argo}/{ns}/cache/model.bin"
    ckpt = [f"{argo}/{ns}/shared/ckpt/step-1", f"{argo}/{ns}/shared/ckpt/step-2"]
    own = [f"{argo}/{ns}/done/out.tgz", f"{argo}/{ns}/shared/report.txt"]
    await plant(s3, model, *ckpt, *own)

    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        running = running_workflow("train", [f"{argo}/{ns}/shared/ckpt"])
        running["status"]["nodes"]["train-1"]["inputs"] = {
            "artifacts": [{"name": "model", "s3": {"key": model}}]
        }
        await kube.workflows.create(ns, running)
        started = datetime.now(UTC)
        await kube.workflows.create(
            ns, workflow_with_outputs("done", [own[0], model, f"{argo}/{ns}/shared"])
        )
        (row,) = (await artifacts_outcomes(config, ns, 1)).values()
        assert row["name"] == "done" and row["outcome"] == "deleted", row
        left = await present(s3, f"{argo}/")
        assert {model, *ckpt} <= left, "a key a Running run records was deleted"
        assert not set(own) & left
        assert row["objectsDeleted"] == 2, row
        assert f"argo:{model} (by {ns}/train)" in row["detail"]
        assert f"argo:{argo}/{ns}/shared/ckpt (by {ns}/train)" in row["detail"]
        print(f"due pass with the live runs read: {datetime.now(UTC) - started}")
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
