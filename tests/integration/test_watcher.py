"""The watcher (one per kind) against a real kube-apiserver: finishes and deletions become
events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from cloudevents.core.base import BaseCloudEvent

from lapse.edges.kubernetes import KubeObjects
from lapse.edges.watch_positions import WatchPositions
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import parse_payload
from lapse.events.kinds import ARGO_WORKFLOW, JOB, KindSpec
from lapse.events.models import RunDeleted, RunFinished
from lapse.events.types import EventType
from lapse.runtime.watcher import RELIST_WINDOW, KindWatcher
from tests.conftest import KubeStack, compact_etcd
from tests.integration.test_kinds import job
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
    # Deleted by someone else (another client), not by this process's own KubeObjects.
    someone_else = KubeObjects(kube.api_client, kube.executor)
    await someone_else.delete(ARGO_WORKFLOW, ns, "ends", uid=done["metadata"]["uid"])
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


async def test_a_deletion_this_process_made_is_not_reported(kube: KubeStack) -> None:
    """`lapse up`'s reaper and watcher share one record of the uids the reaper deleted: the
    deadline behind such a deletion has fired, so run.deleted would make the planner look
    for a schedule to cancel for nothing. Anyone else's deletion is still reported."""
    ns = kube.namespace(f"watch-own-{uuid.uuid4().hex[:6]}")
    ours = KubeObjects(kube.api_client, kube.executor)
    recorder = Recorder()
    watcher = KindWatcher(ours, ARGO_WORKFLOW, recorder.publish, recorder.report)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.wait_for(watcher.synced.wait(), 30)
    mine = await ours.create(ARGO_WORKFLOW, ns, workflow("mine", finished=True))
    theirs = await ours.create(ARGO_WORKFLOW, ns, workflow("theirs", finished=True))
    await wait_for(lambda: _async(len(recorder.names(EventType.RUN_FINISHED, ns)) == 2))

    await ours.delete(ARGO_WORKFLOW, ns, "mine", uid=mine["metadata"]["uid"])
    someone_else = KubeObjects(kube.api_client, kube.executor)
    await someone_else.delete(ARGO_WORKFLOW, ns, "theirs", uid=theirs["metadata"]["uid"])
    # Watch events come in resourceVersion order: once the later deletion is reported, the
    # earlier one has been seen and passed over.
    await wait_for(lambda: _async("theirs" in recorder.names(EventType.RUN_DELETED, ns)))
    stop.set()
    await asyncio.wait_for(task, 10)
    assert recorder.names(EventType.RUN_DELETED, ns) == ["theirs"]
    assert len(ours.own_deletions) == 0  # taken when its DELETED event came


async def test_a_kind_without_a_finished_selector_is_watched_whole(kube: KubeStack) -> None:
    """Jobs: the API server cannot select on status, so every Job is listed and watched;
    the running ones are dropped, the update that finishes one becomes run.finished."""
    objects = kube.workflows.objects
    ns = kube.namespace(f"watch-jobs-{uuid.uuid4().hex[:6]}")
    recorder = Recorder()
    watcher = KindWatcher(objects, JOB, recorder.publish, recorder.report)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.wait_for(watcher.synced.wait(), 30)
    body, finished_status = job(ns, "nightly")
    running = await objects.create(JOB, ns, body)
    await asyncio.sleep(1)  # its ADDED event passes by while it runs
    assert "nightly" not in recorder.names(EventType.RUN_FINISHED, ns)
    running["status"] = finished_status
    done = await objects.replace_status(JOB, ns, "nightly", running)
    await wait_for(lambda: _async("nightly" in recorder.names(EventType.RUN_FINISHED, ns)))
    stop.set()
    await asyncio.wait_for(task, 10)
    [finished] = [
        parse_payload(e, RunFinished)
        for e in recorder.events
        if e.get_type() == EventType.RUN_FINISHED
        and parse_payload(e, RunFinished).run.namespace == ns
    ]
    assert finished.run.uid == done["metadata"]["uid"] and finished.run.kind == "Job"
    assert recorder.failures == []


async def test_a_kind_the_api_server_does_not_serve_is_waited_for(kube: KubeStack) -> None:
    """A configured kind whose CRD is not installed: the watcher says so, counts as synced
    (nothing of it exists) and keeps looking, instead of failing `lapse up`."""
    absent = KindSpec.model_validate(
        {
            "name": "absent",
            "api_version": "example.invalid/v1",
            "kind": "Absent",
            "resource": "absents",
            "finished": {"phases": ["Done"]},
        }
    )
    recorder = Recorder()
    watcher = KindWatcher(
        kube.workflows.objects, absent, recorder.publish, recorder.report, not_served_retry=0.2
    )
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.wait_for(watcher.synced.wait(), 30)
    await wait_for(lambda: _async(watcher.relists >= 3), timeout=30)  # looked for again
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert recorder.events == [] and recorder.failures == []


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


@pytest.fixture
async def positions(nats_server: EmbeddedNats) -> AsyncIterator[WatchPositions]:
    nc = await nats.connect(nats_server.url)
    yield WatchPositions(nc.jetstream())
    await nc.close()


def own_kind() -> KindSpec:
    """Argo Workflows under a name of this test's own: its stored position is its own."""
    return ARGO_WORKFLOW.model_copy(update={"name": f"argo-{uuid.uuid4().hex[:8]}"})


async def test_a_restart_resumes_from_the_stored_position_and_lists_nothing(
    kube: KubeStack, positions: WatchPositions
) -> None:
    ns = kube.namespace(f"resume-{uuid.uuid4().hex[:6]}")
    kind = own_kind()
    first = Recorder()
    watcher = KindWatcher(
        kube.workflows.objects, kind, first.publish, first.report,
        positions=positions, position_interval=0.0,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.wait_for(watcher.synced.wait(), 30)
    before = await kube.workflows.create(ns, workflow("before", finished=True))
    await wait_for(lambda: _async("before" in first.names(EventType.RUN_FINISHED, ns)))

    async def stored_past_it() -> bool:
        stored = await positions.get(kind.name, kube.workflows.objects.cluster)
        return stored is not None and int(stored) >= int(before["metadata"]["resourceVersion"])

    await wait_for(stored_past_it)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert watcher.relists == 1 and watcher.resumes == 0  # nothing was stored: one list

    await kube.workflows.create(ns, workflow("while-away", finished=True))
    again = Recorder()
    restarted = KindWatcher(
        kube.workflows.objects, kind, again.publish, again.report, positions=positions
    )
    stop = asyncio.Event()
    task = asyncio.create_task(restarted.run(stop))
    await wait_for(lambda: _async("while-away" in again.names(EventType.RUN_FINISHED, ns)))
    stop.set()
    await asyncio.wait_for(task, 10)
    # No list: the watch went on from the stored version, so "before" was not sent again.
    assert restarted.relists == 0 and restarted.resumes == 1
    assert again.names(EventType.RUN_FINISHED, ns) == ["while-away"]


async def test_410_with_a_stored_position_lists_and_sends_only_what_is_newer(
    uncached_kube: KubeStack, positions: WatchPositions
) -> None:
    server, workflows = uncached_kube.server, uncached_kube.workflows
    uncached_kube.namespace("stored")
    kind = own_kind()
    await workflows.create("stored", workflow("planned-before", finished=True))
    # Stored by an earlier lapse: everything up to here is in NATS.
    old = (await workflows.list())["metadata"]["resourceVersion"]
    await positions.put(kind.name, workflows.objects.cluster, old)
    for i in range(3):
        await workflows.create("stored", workflow(f"missed-{i}", finished=True))
    compact_etcd(server.etcd_url)

    recorder = Recorder()
    watcher = KindWatcher(
        workflows.objects, kind, recorder.publish, recorder.report, positions=positions
    )
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await wait_for(lambda: _async(len(recorder.names(EventType.RUN_FINISHED, "stored")) >= 3))
    await asyncio.wait_for(watcher.synced.wait(), 30)
    await wait_for(lambda: _async(watcher.relist is None))  # the re-list is over
    stop.set()
    await asyncio.wait_for(task, 10)
    assert watcher.resumes == 1 and watcher.relists == 1  # tried the position; 410; listed
    # The run planned before the stored position is not sent again; the missed ones are.
    finished = sorted(recorder.names(EventType.RUN_FINISHED, "stored"))
    assert finished == ["missed-0", "missed-1", "missed-2"]
    # The list is published: the position moved on past it.
    stored = await positions.get(kind.name, workflows.objects.cluster)
    assert stored is not None and int(stored) > int(old)


async def test_a_position_stored_for_another_cluster_is_not_used(
    kube: KubeStack, positions: WatchPositions
) -> None:
    ns = kube.namespace(f"elsewhere-{uuid.uuid4().hex[:6]}")
    kind = own_kind()
    await kube.workflows.create(ns, workflow("here", finished=True))
    # Another API server's version, far ahead of this one's: meaningless here.
    await positions.put(kind.name, "https://elsewhere.example:6443", "999999999")
    recorder = Recorder()
    watcher = KindWatcher(
        kube.workflows.objects, kind, recorder.publish, recorder.report, positions=positions
    )
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await wait_for(lambda: _async("here" in recorder.names(EventType.RUN_FINISHED, ns)))
    stop.set()
    await asyncio.wait_for(task, 10)
    assert watcher.resumes == 0 and watcher.relists == 1


class WindowRecorder(Recorder):
    """Acks each publish a moment later, counting how many are awaited at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.most_in_flight = 0

    async def publish(self, event: BaseCloudEvent) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.005)
        self.in_flight -= 1
        await super().publish(event)


async def test_a_relist_publishes_in_windows_and_is_synced_once_all_are_acknowledged(
    kube: KubeStack,
) -> None:
    ns = kube.namespace(f"window-{uuid.uuid4().hex[:6]}")
    count = 2 * RELIST_WINDOW + 22  # two full windows and a partial one
    names = [f"wf-{i:03d}" for i in range(count)]
    await asyncio.gather(*(kube.workflows.create(ns, workflow(n, finished=True)) for n in names))
    lane = WindowRecorder()
    live = Recorder()
    watcher = KindWatcher(
        kube.workflows.objects, ARGO_WORKFLOW, live.publish, live.report,
        publish_relist=lane.publish,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.wait_for(watcher.synced.wait(), 60)
        # Synced only once every listed event was acknowledged: none is still in flight.
        assert lane.in_flight == 0
        assert sorted(lane.names(EventType.RUN_FINISHED, ns)) == names  # each exactly once
        assert 1 < lane.most_in_flight <= RELIST_WINDOW  # pipelined, and bounded
        assert live.names(EventType.RUN_FINISHED, ns) == []  # the list is not the live lane
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
