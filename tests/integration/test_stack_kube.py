"""The kube-apiserver with the real Argo Workflow CRD works through lapse's Kubernetes edge."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import KubeStack


def workflow(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": {"workflows.argoproj.io/completed": "false"}},
        "spec": {
            "entrypoint": "main",
            "templates": [{"name": "main", "container": {"image": "alpine"}}],
        },
    }


async def test_create_get_watch_delete(kube: KubeStack) -> None:
    ns = kube.namespace("stack-crud")
    wfs = kube.workflows
    created = await wfs.create(ns, workflow("wf-a"))
    uid = created["metadata"]["uid"]
    fetched = await wfs.get(ns, "wf-a")
    assert fetched is not None and fetched["metadata"]["uid"] == uid

    # Argo's CRD has no status subresource: status is written with the object.
    fetched["status"] = {"phase": "Succeeded", "finishedAt": "2026-11-21T10:00:00Z"}
    fetched["metadata"]["labels"]["workflows.argoproj.io/completed"] = "true"
    updated = await wfs.replace(ns, "wf-a", fetched)
    assert updated["status"]["phase"] == "Succeeded"

    listing = await wfs.list(ns)
    seen: list[tuple[str, str]] = []

    async def watch_until_deleted() -> None:
        async for event in wfs.watch(resource_version=listing["metadata"]["resourceVersion"]):
            if event.type == "BOOKMARK":
                continue
            seen.append((event.type, event.object["metadata"]["name"]))
            if event.type == "DELETED":
                return

    watcher = asyncio.create_task(watch_until_deleted())
    await asyncio.sleep(0.5)
    await wfs.delete(ns, "wf-a", uid=uid, resource_version=updated["metadata"]["resourceVersion"])
    await asyncio.wait_for(watcher, timeout=30)
    assert seen[-1] == ("DELETED", "wf-a")
    assert await wfs.get(ns, "wf-a") is None


async def test_delete_with_wrong_uid_is_refused(kube: KubeStack) -> None:
    ns = kube.namespace("stack-precondition")
    wfs = kube.workflows
    old = await wfs.create(ns, workflow("reused"))
    await wfs.delete(ns, "reused", uid=old["metadata"]["uid"])
    new = await wfs.create(ns, workflow("reused"))  # same name, new uid
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    with pytest.raises(ApiException) as refused:
        await wfs.delete(ns, "reused", uid=old["metadata"]["uid"])
    assert refused.value.status == 409
    survivor = await wfs.get(ns, "reused")
    assert survivor is not None and survivor["metadata"]["uid"] == new["metadata"]["uid"]

    with pytest.raises(ApiException) as stale:
        await wfs.delete(ns, "reused", uid=new["metadata"]["uid"], resource_version="1")
    assert stale.value.status == 409
