"""Argo's artifact repository ConfigMap read from a real kube-apiserver: an Argo < 3.1
Workflow records its artifact keys without a bucket and names the repository only by its
ConfigMap (`status.artifactRepositoryRef`); the planner reads the bucket there, so the
keys are captured in the store that holds that bucket."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from lapse.edges.artifacts import ConfigMapRepositories
from lapse.events.adapters.argo_artifacts import argo_artifacts
from lapse.events.kinds import DEFAULT_KINDS
from lapse.events.run import Engine, RunRef
from lapse.functions.artifact_reaper import ArtifactsConfig, RunCapture
from lapse.functions.artifact_reaper.capture import CapturedItem
from lapse.functions.ttl_planner.artifacts import ArtifactPlanning
from tests.conftest import KubeStack

pytestmark = [pytest.mark.kube]

REPOSITORY = "s3:\n  bucket: from-configmap\n  endpoint: minio:9000\n  keyFormat: x\n"


class Kept:
    """The capture store: what the planner would put in LAPSE_ARTIFACTS, held here (the
    subject is the ConfigMap read; the bucket itself is tested in test_artifact_reaper)."""

    def __init__(self) -> None:
        self.captures: dict[str, RunCapture] = {}

    async def put(self, capture: RunCapture) -> None:
        self.captures[capture.uid] = capture

    async def get(self, uid: str) -> RunCapture | None:
        return self.captures.get(uid)

    async def sharers(self, item: CapturedItem, uid: str) -> tuple[str, ...]:
        return ()

    async def forget(self, capture: RunCapture) -> None:
        self.captures.pop(capture.uid, None)


async def test_keys_without_a_bucket_take_the_configmaps_repository(kube: KubeStack) -> None:
    ns = kube.namespace(f"repo-{uuid.uuid4().hex[:6]}")
    core = client.CoreV1Api(kube.api_client)
    core.create_namespaced_config_map(
        ns,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(
                name="artifact-repositories",
                annotations={"workflows.argoproj.io/default-artifact-repository": "main"},
            ),
            data={"main": REPOSITORY},
        ),
    )
    workflow = {
        "metadata": {"name": "wf", "namespace": ns},
        "status": {
            "artifactRepositoryRef": {"configMap": "artifact-repositories", "namespace": ns},
            "nodes": {"wf-1": {"outputs": {"artifacts": [
                {"name": "main-logs", "s3": {"key": "wf/wf-1/main.log"}},
            ]}}},
        },
    }  # fmt: skip
    recorded = argo_artifacts(workflow)
    assert recorded is not None and recorded.repository is not None
    config = ArtifactsConfig.model_validate(
        {
            "stores": [
                {"name": "argo", "url": "s3://from-configmap/", "endpoint": "http://minio:9000"}
            ]
        }
    )
    kept = Kept()
    planning = ArtifactPlanning(config, kept, ConfigMapRepositories(kube.api_client, kube.executor))
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=ns, name="wf", uid=str(uuid.uuid4()), phase="Succeeded",
    )  # fmt: skip
    await planning.capture(run, recorded, DEFAULT_KINDS)
    capture = kept.captures[run.uid]
    assert capture.items == (CapturedItem(store="argo", key="wf/wf-1/main.log", tree=False),)
    assert capture.outside == ()

    # A repository ConfigMap that is gone: the key is outside every store, never deleted.
    gone = recorded.model_copy(
        update={"repository": recorded.repository.model_copy(update={"config_map": "nope"})}
    )
    other = run.model_copy(update={"uid": str(uuid.uuid4())})
    await planning.capture(other, gone, DEFAULT_KINDS)
    assert kept.captures[other.uid].items == ()
    assert kept.captures[other.uid].outside == ("s3://?/wf/wf-1/main.log",)
