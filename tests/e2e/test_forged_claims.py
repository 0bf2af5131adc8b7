"""Deletion claims through `lapse up`'s ingress cancel nothing the API server does not
confirm (issue 36, "the tenant boundary").

Before the fix, both of these were answered 202 and withdrew the object's deadline, so the
object outlived its TTL:
- an ApiServerSource Reference-mode `ref.delete` naming an object that exists (the planner
  read it, and believed the event's "deleted" of what it had just read);
- a `run.deleted` carrying an existing object's uid under another name (the planner read
  the name the claim chose, found nothing there, and withdrew the uid's schedule).

Now a deletion claim is refused (`cleanup.failed`, stage `planner`) unless the object lapse
stored the schedule for, read by the namespace and name lapse stored, is gone or holds
another uid; the object is then deleted at its deadline. A genuine deletion still withdraws
the schedule.

Real NATS and kube-apiserver; `lapse up --no-watch` as a subprocess, so the ingress is the
only way lapse hears of the runs (the watcher would otherwise withdraw on its own, OBSERVED,
deletion events, which is not what is tested here).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bench.report import parse_timestamp
from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import RunDeleted
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from tests.conftest import KubeStack
from tests.e2e.test_forged_events import post
from tests.e2e.test_forged_inputs import audit
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, ingress_config, reference_event
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

# Long enough for the claim to be handled well before it, short enough to wait for.
TTL_SECONDS = 8


@dataclass
class Up:
    """One `lapse up --no-watch` and what the checks read: its ingress, the schedules lapse
    stored, the audit trail."""

    process: LapseUp
    js: JetStreamContext
    store: NatsScheduleStore

    @property
    def ingress(self) -> str:
        return f"http://127.0.0.1:{self.process.ingress_port}/"

    async def push_reference(self, wf: dict[str, Any], action: str) -> None:
        headers, body = reference_event(wf, action)
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(self.ingress, headers=headers, content=body)
        assert answer.status_code == 202, answer.text

    async def push_deleted(self, run: RunRef) -> None:
        event = build_event(EventType.RUN_DELETED, source="/forged", data=RunDeleted(run=run))
        answer = await post(self.ingress, event)
        assert answer.status_code == 202, answer.text

    async def planned(self, wf: dict[str, Any]) -> datetime:
        """Plans `wf` through the ingress (a Reference-mode update) and returns the
        Kubernetes deadline lapse stored for it."""
        await self.push_reference(wf, "update")
        uid = wf["metadata"]["uid"]

        async def stored() -> datetime | None:
            pending = await self.store.get(Target.KUBERNETES, uid)
            return pending.deadline if pending is not None else None

        return await wait_for(stored, timeout=30, interval=0.1)

    async def records(self, uid: str) -> list[dict[str, Any]]:
        """The audit trail's records about the run with `uid`."""
        return [
            r for r in (await audit(self.js)).values() if (r.get("run") or {}).get("uid") == uid
        ]

    async def answers(self, uid: str, count: int) -> list[dict[str, Any]]:
        """The planner's answers to deletion claims about `uid`, as recorded: refusals
        (`cleanup.failed`, stage planner) and withdrawals (`cleanup.cancelled`), once there
        are `count` of them or a withdrawal (which settles it: a later claim finds nothing
        to withdraw, and is silent)."""

        async def found() -> list[dict[str, Any]] | None:
            answers = [
                r
                for r in await self.records(uid)
                if r["type"] == EventType.CLEANUP_CANCELLED
                or (r["type"] == EventType.CLEANUP_FAILED and r["stage"] == "planner")
            ]
            withdrawn = any(a["type"] == EventType.CLEANUP_CANCELLED for a in answers)
            return answers if len(answers) >= count or withdrawn else None

        return await wait_for(found, timeout=20, interval=0.1)


@pytest.fixture(scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory, kube: KubeStack) -> AsyncIterator[Up]:
    tmp = tmp_path_factory.mktemp("forged-claims")
    nats = EmbeddedNats(tmp / "nats").start()
    process = LapseUp(
        ingress_config(tmp / "lapse.yaml", nats.url, kube, None), tmp / "state", tmp / "up.log"
    )
    process.args.append("--no-watch")
    nc: NatsClient | None = None
    try:
        await process.start()
        nc = await connect(nats.url)
        js = nc.jetstream()
        yield Up(process, js, NatsScheduleStore(js, Streams()))
    finally:
        if nc is not None:
            await nc.close()
        code = process.stop()
        nats.stop()
        assert code == 0, (tmp / "up.log").read_text()[-3000:]


def short_lived(name: str) -> dict[str, Any]:
    return finished_workflow(name, annotations={"lapse.dev/ttl": f"{TTL_SECONDS}s"})


def run_of(wf: dict[str, Any], **changes: str) -> RunRef:
    meta = wf["metadata"]
    fields: dict[str, Any] = {
        "engine": Engine.ARGO, "api_version": wf["apiVersion"], "kind": wf["kind"],
        "namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"],
        "phase": "Succeeded", "finished_at": datetime.now(UTC),
    }  # fmt: skip
    return RunRef(**{**fields, **changes})


async def deleted_at_its_deadline(kube: KubeStack, wf: dict[str, Any], deadline: datetime) -> None:
    """`wf` is deleted by lapse at `deadline` (its schedule was not withdrawn)."""
    ns, name = wf["metadata"]["namespace"], wf["metadata"]["name"]

    async def gone() -> bool:
        return await kube.workflows.get(ns, name) is None

    await wait_for(gone, timeout=TTL_SECONDS + 20, interval=0.2)
    assert datetime.now(UTC) >= deadline - timedelta(seconds=1), "deleted before its deadline"


async def test_a_reference_mode_delete_of_an_object_that_exists_is_refused(
    up: Up, kube: KubeStack
) -> None:
    ns = kube.namespace(f"claims-{uuid.uuid4().hex[:6]}")
    wf = await kube.workflows.create(ns, short_lived("still-here"))
    uid = wf["metadata"]["uid"]
    deadline = await up.planned(wf)
    assert deadline == datetime.fromtimestamp(
        parse_timestamp(wf["status"]["finishedAt"]) + TTL_SECONDS, UTC
    )

    await up.push_reference(wf, "delete")

    [refused] = await up.answers(uid, 1)
    assert refused["type"] == EventType.CLEANUP_FAILED, (
        f"the claim withdrew the deadline: {refused}"
    )
    assert refused["reason"].startswith("refused: "), refused
    assert "still exists" in refused["reason"] and "no schedule was withdrawn" in refused["reason"]
    assert json.loads(refused["original"]["data"])["name"] == "still-here"
    pending = await up.store.get(Target.KUBERNETES, uid)
    assert pending is not None and not pending.fired and pending.deadline == deadline
    await deleted_at_its_deadline(kube, wf, deadline)
    assert not any(r["type"] == EventType.CLEANUP_CANCELLED for r in await up.records(uid))


async def test_a_run_deleted_with_an_existing_uid_under_another_name_is_refused(
    up: Up, kube: KubeStack
) -> None:
    ns = kube.namespace(f"claims-{uuid.uuid4().hex[:6]}")
    wf = await kube.workflows.create(ns, short_lived("victim"))
    other = await kube.workflows.create(ns, finished_workflow("bystander"))
    uid = wf["metadata"]["uid"]
    deadline = await up.planned(wf)

    # The victim's uid under a name that does not exist, and under one that holds another
    # object: either absence, read where the claim points, once withdrew the deadline.
    await up.push_deleted(run_of(wf, name="no-such-workflow"))
    await up.push_deleted(run_of(wf, name=other["metadata"]["name"]))

    answers = await up.answers(uid, 2)
    assert all(a["type"] == EventType.CLEANUP_FAILED for a in answers), (
        f"a claim withdrew the deadline: {answers}"
    )
    reasons = [a["reason"] for a in answers]
    for reason, named in zip(sorted(reasons), ("bystander", "no-such-workflow"), strict=True):
        assert f"Workflow {ns}/victim (uid {uid}) still exists" in reason, reason
        assert f"the claim named {ns}/{named}" in reason, reason
    pending = await up.store.get(Target.KUBERNETES, uid)
    assert pending is not None and pending.deadline == deadline
    await deleted_at_its_deadline(kube, wf, deadline)
    assert await kube.workflows.get(ns, "bystander") is not None
    assert not any(r["type"] == EventType.CLEANUP_CANCELLED for r in await up.records(uid))


async def test_a_genuine_deletion_still_withdraws_the_schedule(up: Up, kube: KubeStack) -> None:
    ns = kube.namespace(f"claims-{uuid.uuid4().hex[:6]}")
    kept_an_hour = {"lapse.dev/ttl": "1h"}
    gone = await kube.workflows.create(ns, finished_workflow("gone", annotations=kept_an_hour))
    reborn = await kube.workflows.create(ns, finished_workflow("reborn", annotations=kept_an_hour))
    for wf in (gone, reborn):
        await up.planned(wf)
        await kube.workflows.delete(ns, wf["metadata"]["name"], uid=wf["metadata"]["uid"])
    # The name is another object's now: the uid lapse stored is gone all the same.
    successor = await kube.workflows.create(ns, finished_workflow("reborn"))
    assert successor["metadata"]["uid"] != reborn["metadata"]["uid"]

    for wf in (gone, reborn):
        await up.push_deleted(run_of(wf))

    for wf in (gone, reborn):
        uid = wf["metadata"]["uid"]
        [answer] = await up.answers(uid, 1)
        assert answer["type"] == EventType.CLEANUP_CANCELLED, answer
        assert answer["target"] == Target.KUBERNETES
        assert await up.store.get(Target.KUBERNETES, uid) is None
    assert await kube.workflows.get(ns, "reborn") is not None
