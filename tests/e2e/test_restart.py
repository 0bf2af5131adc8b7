"""Restarts that cost nothing (issue 27): `lapse up`'s pipeline, in this process, against a
real kube-apiserver (whose audit log counts the LISTs) and NATS.

- A restart with a stored watch position lists nothing: the watch resumes from it.
- With nothing stored, the re-list of thousands of unchanged runs goes on its own lane: a
  run that finishes meanwhile is planned before the re-list is over, and the re-list
  changes no schedule.
- Runs that finished while lapse was down are in the list itself, and a list comes in name
  order: those whose names sort after every unchanged run's are still planned long before
  the re-list's lane is through (they go on the live lane).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from lapse.config import LapseConfig, Streams, load_config
from lapse.edges.nats import connect
from lapse.edges.streams import count_messages
from lapse.edges.watch_positions import WatchPositions
from lapse.embedded.nats import EmbeddedNats
from lapse.events.subjects import audit_subject
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType
from lapse.runtime.pipeline import Pipeline
from lapse.runtime.routing import load_routes, relist_lane
from lapse.runtime.watcher import KindWatcher
from tests.conftest import KubeStack
from tests.e2e.apiserver_audit import audited_kube_stack
from tests.e2e.test_lapse_up import finished_workflow
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

STREAMS = Streams()
KIND = "argo-workflow"
# Enough unchanged runs that re-listing and re-planning them takes a while here.
MANY = 2500


@pytest.fixture(scope="module")
def audited_kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeStack, Path]]:
    with audited_kube_stack(tmp_path_factory.mktemp("restart"), verbs=("list",)) as found:
        yield found


def workflow_lists(audit_log: Path) -> int:
    """LIST requests of Workflows the API server answered (a watch is a `watch` verb)."""
    count = 0
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if event.get("stage") == "ResponseComplete" and ref.get("resource") == "workflows":
            count += event.get("verb") == "list"
    return count


def config_for(path: Path, kube: KubeStack) -> LapseConfig:
    path.write_text(
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"kinds: [{KIND}]\n"
        "policies:\n"
        "  - name: everything\n"
        "    match: {}\n"
        "    kubernetes: {ttl: 1h}\n"
        "safety: {namespaces: {include: ['*']}}\n"
    )
    return load_config(path, env={})


class Running:
    """One `lapse up` pipeline, in this process."""

    def __init__(self, config: LapseConfig, nats_url: str) -> None:
        self.pipeline = Pipeline(config, nats_url=nats_url)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Running:
        self.task = asyncio.create_task(self.pipeline.run(self.stop))
        await asyncio.wait_for(self.pipeline.ready.wait(), timeout=60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=60)

    @property
    def watcher(self) -> KindWatcher:
        (watcher,) = self.pipeline.watchers
        return watcher


async def scheduled(js: JetStreamContext, uid: str) -> bool:
    return await count_messages(js, STREAMS.schedule, f"lapse.sched.kubernetes.{uid}") > 0


def old_workflow(name: str) -> dict[str, Any]:
    """A run that finished ten minutes ago: before any restart here, and well inside its 1h
    TTL (the watcher's RECENT_FINISH is 60 s)."""
    obj = finished_workflow(name)
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    obj["status"]["startedAt"] = obj["status"]["finishedAt"] = format_rfc3339(finished)
    return obj


async def create_many(kube: KubeStack, ns: str, count: int) -> list[dict[str, Any]]:
    created: list[dict[str, Any]] = []
    for start in range(0, count, 50):
        batch = [
            kube.workflows.create(ns, old_workflow(f"old-{i}"))
            for i in range(start, min(start + 50, count))
        ]
        created += await asyncio.gather(*batch)
    return created


async def touch_all(kube: KubeStack, ns: str, objects: list[dict[str, Any]]) -> None:
    for start in range(0, len(objects), 50):
        batch = []
        for obj in objects[start : start + 50]:
            obj["metadata"]["labels"]["touched"] = "yes"
            batch.append(kube.workflows.replace(ns, obj["metadata"]["name"], obj))
        await asyncio.gather(*batch)


async def planned_then_relisted(
    kube: KubeStack, ns: str, config: LapseConfig, nats_url: str, js: JetStreamContext
) -> None:
    """MANY finished runs planned by one `lapse up`, which stops; then, as after a 410 Gone
    or a first start on a cluster lapse planned before, nothing is stored to resume from,
    and each run's version is a new one (a label no policy reads), as later than
    JetStream's duplicate window: the next start lists each again, and finds it unchanged."""
    created = await create_many(kube, ns, MANY)
    async with Running(config, nats_url):

        async def all_planned() -> bool:
            pending = await count_messages(js, STREAMS.schedule, "lapse.sched.kubernetes.>")
            return pending >= MANY

        await wait_for(all_planned, timeout=300, interval=0.5)
    await WatchPositions(js).forget(KIND)
    await touch_all(kube, ns, created)


async def relist_backlog(js: JetStreamContext) -> int:
    """Events on the planner's re-list lane not yet handled."""
    (lane,) = [r for route in load_routes() if (r := relist_lane(route)) is not None]
    info = await js.consumer_info(STREAMS.events, f"lapse-{lane.name}")
    return int(info.num_pending + info.num_ack_pending)


async def test_a_restart_with_a_stored_position_lists_nothing(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, audit_log = audited_kube
    ns = kube.namespace(f"resume-{uuid.uuid4().hex[:6]}")
    config = config_for(tmp_path / "lapse.yaml", kube)
    nc = await connect(own_nats.url)
    js = nc.jetstream()
    try:
        async with Running(config, own_nats.url) as first:
            await asyncio.wait_for(first.watcher.synced.wait(), 30)
            before = await kube.workflows.create(ns, finished_workflow("before"))
            await wait_for(lambda: scheduled(js, before["metadata"]["uid"]))
        assert first.watcher.relists == 1  # nothing was stored yet: one list
        stored = await WatchPositions(js).get(KIND, kube.workflows.objects.cluster)
        assert stored is not None
        assert int(stored) >= int(before["metadata"]["resourceVersion"])

        away = await kube.workflows.create(ns, finished_workflow("while-away"))
        lists = workflow_lists(audit_log)
        async with Running(config, own_nats.url) as second:
            await wait_for(lambda: scheduled(js, away["metadata"]["uid"]))
            assert second.watcher.relists == 0 and second.watcher.resumes == 1
        # The API server's own account: no LIST of Workflows since the restart.
        assert workflow_lists(audit_log) == lists
    finally:
        await nc.close()


async def test_a_finish_during_a_relist_is_planned_before_the_relist_ends(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, _ = audited_kube
    ns = kube.namespace(f"relist-{uuid.uuid4().hex[:6]}")
    config = config_for(tmp_path / "lapse.yaml", kube)
    nc = await connect(own_nats.url)
    js = nc.jetstream()
    scheduled_events = audit_subject(EventType.CLEANUP_SCHEDULED)
    try:
        await planned_then_relisted(kube, ns, config, own_nats.url, js)
        planned_before = await count_messages(js, STREAMS.audit, scheduled_events)
        async with Running(config, own_nats.url) as second:
            await wait_for(lambda: _now(second.watcher.relist is not None), interval=0.01)
            fresh = await kube.workflows.create(ns, finished_workflow("finished-meanwhile"))
            await wait_for(lambda: scheduled(js, fresh["metadata"]["uid"]), interval=0.05)
            relisting = second.watcher.relist is not None or await relist_backlog(js) > 0

            async def relist_over() -> bool:
                return second.watcher.relist is None and not await relist_backlog(js)

            await wait_for(relist_over, timeout=300)
        assert relisting, "the re-list was over before the new finish was planned"
        # The re-list changed no schedule: the one new run is all that was scheduled.
        assert await count_messages(js, STREAMS.audit, scheduled_events) == planned_before + 1
    finally:
        await nc.close()


async def test_runs_that_finished_during_the_restart_do_not_wait_for_the_relist(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, _ = audited_kube
    ns = kube.namespace(f"meanwhile-{uuid.uuid4().hex[:6]}")
    config = config_for(tmp_path / "lapse.yaml", kube)
    nc = await connect(own_nats.url)
    js = nc.jetstream()
    try:
        await planned_then_relisted(kube, ns, config, own_nats.url, js)
        # Finished while lapse was down; "zz-" sorts after every "old-": the list's end.
        meanwhile = [
            await kube.workflows.create(ns, finished_workflow(f"zz-finished-meanwhile-{i}"))
            for i in range(5)
        ]
        async with Running(config, own_nats.url) as second:

            async def all_meanwhile_planned() -> bool:
                for obj in meanwhile:
                    if not await scheduled(js, obj["metadata"]["uid"]):
                        return False
                return True

            await wait_for(all_meanwhile_planned, timeout=120, interval=0.05)
            # Had they gone on the re-list lane they would be its last events, planned once
            # the lane is through: what is still waiting on it shows they did not.
            behind = await relist_backlog(js)

            async def relist_over() -> bool:
                return second.watcher.relist is None and not await relist_backlog(js)

            await wait_for(relist_over, timeout=300)
        print(f"\nfinished during the restart: planned with {behind} re-listed runs still to plan")
        assert behind >= MANY // 5, f"only {behind} re-listed runs were still to plan"
    finally:
        await nc.close()


async def _now(value: bool) -> bool:
    return value
