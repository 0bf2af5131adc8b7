"""`lapse up` (a subprocess, as users run it) and its embedded S3 server: on embedded
defaults it starts SeaweedFS beside the local cluster and deletes a Workflow's artifacts
there on the artifacts clock; with a cluster configured it never starts one; with SeaweedFS
not built it says so in one line and runs without the artifacts target.
"""

from __future__ import annotations

import re
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kubernetes import client as kube_client
from obstore.store import S3Store

from lapse.cli.up_run import EMBEDDED_BUCKET
from lapse.edges.kubernetes import Workflows, load_api_client
from lapse.embedded.seaweedfs import REGION, identities_path, read_keys
from tests.conftest import KubeStack
from tests.e2e.test_artifacts_up import workflow_with_outputs
from tests.e2e.test_lapse_up import LapseUp
from tests.integration.test_artifact_reaper import plant, present
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

S3_LINE = re.compile(r"started an S3 server \(SeaweedFS\) at (http://127\.0\.0\.1:\d+)")


def s3_client(state_dir: Path, endpoint: str) -> S3Store:
    """A client with the keys `lapse up` left in its state directory, as a user's would."""
    keys = read_keys(state_dir / "seaweedfs")
    assert keys is not None, "no keys in the state directory"
    return S3Store(
        EMBEDDED_BUCKET,
        endpoint=endpoint,
        region=REGION,
        access_key_id=keys[0],
        secret_access_key=keys[1],
        client_options={"allow_http": True},
    )


async def test_up_on_embedded_defaults_deletes_artifacts_in_its_own_s3_server(
    tmp_path: Path,
) -> None:
    config = tmp_path / "lapse.yaml"
    config.write_text(
        "policies:\n"
        "  - name: clocks\n"
        "    kubernetes: {ttl: 2s}\n"
        "    artifacts: {ttl: 8s}\n"
        "safety: {max_deletions_per_second: 1000}\n"
    )
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    up = LapseUp(config, state_dir, log)
    await up.start()
    executor = ThreadPoolExecutor(max_workers=4)
    try:
        text = log.read_text()
        found = S3_LINE.search(text)
        assert found, text[-3000:]
        endpoint = found.group(1)
        keys = read_keys(state_dir / "seaweedfs")
        assert keys is not None
        assert keys[1] not in text, "the secret key was logged"
        mode = stat.S_IMODE(identities_path(state_dir / "seaweedfs").stat().st_mode)
        assert mode == 0o600, oct(mode)

        api_client = load_api_client((state_dir / "kubeconfig.path").read_text().strip())
        ns = f"s3-{uuid.uuid4().hex[:6]}"
        core = kube_client.CoreV1Api(api_client)
        core.create_namespace(kube_client.V1Namespace(metadata=kube_client.V1ObjectMeta(name=ns)))
        workflows = Workflows(api_client, executor)

        # Below the run's namespace: the store's default root for what a run records.
        base = f"{ns}/wf"
        outputs = [f"{base}/wf-1/main.log", f"{base}/wf-1/model.tgz"]
        beside = [f"{base}/wf-1/main.log.1", f"{base}/wf-2/main.log", f"other/{base}/wf-1/x"]
        s3 = s3_client(state_dir, endpoint)
        await plant(s3, *outputs, *beside)
        await workflows.create(ns, workflow_with_outputs("wf", outputs))

        async def object_gone() -> bool:
            return not (await workflows.list(ns))["items"]

        await wait_for(object_gone, timeout=60, interval=0.3)
        # The object went on its clock; the artifacts wait for theirs.
        assert set(outputs) <= await present(s3), "artifacts went with the object"

        async def artifacts_gone() -> bool:
            return not set(outputs) & await present(s3)

        await wait_for(artifacts_gone, timeout=60, interval=0.3)
        assert set(beside) <= await present(s3), "an object beside the run's keys was deleted"
        api_client.close()
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        assert up.stop() == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()


async def test_up_with_a_cluster_configured_starts_no_s3_server(
    tmp_path: Path, kube: KubeStack
) -> None:
    config = tmp_path / "lapse.yaml"
    config.write_text(f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n")
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    up = LapseUp(config, state_dir, log)
    await up.start()
    try:
        text = log.read_text()
        assert "lapse is running" in text
        assert "S3 server" not in text, text[-3000:]
        assert not (state_dir / "seaweedfs").exists()
    finally:
        assert up.stop() == 0, log.read_text()[-3000:]


async def test_up_without_seaweedfs_built_says_so_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A version never built stands for a machine where `make seaweedfs` was not run.
    monkeypatch.setenv("LAPSE_SEAWEEDFS_VERSION", "v0.0.0-never-built")
    config = tmp_path / "lapse.yaml"
    config.write_text("policies: []\n")
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    up = LapseUp(config, state_dir, log)
    await up.start()
    try:
        lines = [line for line in log.read_text().splitlines() if "SeaweedFS" in line]
        assert len(lines) == 1, lines
        assert "make seaweedfs" in lines[0] and "without the artifacts target" in lines[0]
        assert not (state_dir / "seaweedfs").exists()
    finally:
        assert up.stop() == 0, log.read_text()[-3000:]
