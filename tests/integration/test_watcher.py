"""The Argo watcher against a real kube-apiserver: finishes and deletions become events."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent

from events.builder import parse_payload
from events.kinds import ARGO_WORKFLOW
from events.models import RunDeleted, RunFinished
from events.types import EventType
from lapse.runtime.watcher import KindWatcher
from tests.conftest import KubeStack, kube_stack
from tests.stack import wait_for


def workflow(name: str, *, finished: bool) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true" if finished else "false"},
        },
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Running", "startedAt": "2026-11-21T10:00:00Z"},
    }
    if finished:
        obj["status"] = {
            **obj["status"],
            "phase": "Succeeded",
            "finishedAt": "2026-11-21T10:05:00Z",
        }
    return obj


class Recorder:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []
        self.failures: list[BaseCloudEvent] = []

    async def publish(self, event: BaseCloudEvent) -> None:
        self.events.append(event)

    async def report(self, event: BaseCloudEvent) -> None:
        self.failures.append(event)

    def names(self, event_type: EventType, namespace: str) -> list[str]:
        # The watcher is cluster-wide: other tests' workflows pass by too.
        runs = [parse_payload(e).run for e in self.events if e.get_type() == event_type]  # type: ignore[union-attr]
        return [run.name for run in runs if run.namespace == namespace]


async def test_finish_and_delete_become_events(kube: KubeStack) -> None:
    ns = kube.namespace(f"watch-{uuid.uuid4().hex[:6]}")
    recorder = Recorder()
    watcher = KindWatcher(kube.workflows.objects, ARGO_WORKFLOW, recorder.publish, recorder.report)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.wait_for(watcher.synced.wait(), 30)

    running = await kube.workflows.create(ns, workflow("goes-on", finished=False))
    created = await kube.workflows.create(ns, workflow("ends", finished=False))
    created["metadata"]["labels"]["workflows.argoproj.io/completed"] = "true"
    created["status"] = workflow("ends", finished=True)["status"]
    done = await kube.workflows.replace(ns, "ends", created)
    await wait_for(lambda: _async("ends" in recorder.names(EventType.RUN_FINISHED, ns)))
    await kube.workflows.delete(ns, "ends", uid=done["metadata"]["uid"])
    await wait_for(lambda: _async("ends" in recorder.names(EventType.RUN_DELETED, ns)))

    stop.set()
    await asyncio.wait_for(task, 10)
    assert "goes-on" not in recorder.names(EventType.RUN_FINISHED, ns)
    finished = next(
        payload
        for e in recorder.events
        if e.get_type() == EventType.RUN_FINISHED
        and (payload := parse_payload(e, RunFinished)).run.namespace == ns
    )
    assert finished.run.uid == done["metadata"]["uid"]
    assert running["metadata"]["uid"] not in {
        parse_payload(e).run.uid
        for e in recorder.events  # type: ignore[union-attr]
    }
    assert recorder.failures == []


async def _async(value: bool) -> bool:
    return value


@pytest.fixture
def uncached_kube(tmp_path: Path) -> Iterator[KubeStack]:
    # Without a watch cache for Workflows, watches are served by etcd, so compacting etcd
    # makes an old resourceVersion answer 410 Gone, as it does in production after a
    # long disconnect.
    no_cache = ("--watch-cache-sizes=workflows.argoproj.io#0",)
    with kube_stack(tmp_path / "kube", extra_args=no_cache) as stack:
        yield stack


def compact_etcd(etcd_url: str) -> None:
    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            etcd_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.load(response)
            return result

    revision = call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
    call("/v3/kv/compaction", {"revision": revision, "physical": True})


async def test_410_gone_relists_and_misses_no_finish(
    uncached_kube: KubeStack,
) -> None:
    server, workflows = uncached_kube.server, uncached_kube.workflows
    uncached_kube.namespace("gone")
    resume_from = (await workflows.list())["metadata"]["resourceVersion"]
    # While lapse is away: runs finish, and etcd compacts the history it would resume from.
    for i in range(3):
        await workflows.create("gone", workflow(f"missed-{i}", finished=True))
    compact_etcd(server.etcd_url)

    recorder = Recorder()
    watcher = KindWatcher(workflows.objects, ARGO_WORKFLOW, recorder.publish, recorder.report)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop, resume_from=resume_from))
    await wait_for(lambda: _async(len(recorder.names(EventType.RUN_FINISHED, "gone")) >= 3))
    stop.set()
    await asyncio.wait_for(task, 10)
    assert watcher.relists == 1  # the 410 made it list; nothing else did
    finished = sorted(recorder.names(EventType.RUN_FINISHED, "gone"))
    assert finished == ["missed-0", "missed-1", "missed-2"]
    assert not any(isinstance(parse_payload(e), RunDeleted) for e in recorder.events)
