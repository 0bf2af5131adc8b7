"""Deletion claims: what the planner reads to confirm one (`claims.py`, pure) and what it
does with each answer (`Planner.handle`, with in-memory schedules and objects).

The real edges are exercised through `lapse up` in tests/e2e/test_forged_claims.py; here a
failing read (which the real kube-apiserver cannot be made to give on demand) and inputs the
e2e does not send (a reference carrying a uid, a schedule whose content cannot be read
back) are covered.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent

from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupCancelled, CleanupDue, CleanupFailed, RunDeleted
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.functions.ports import PendingSchedule
from lapse.functions.trust import Trust
from lapse.functions.ttl_planner import Planner
from lapse.functions.ttl_planner.claims import Refusal, judge_deletion, where_to_read
from tests.fakes import FakeSchedules
from tests.unit.test_object_reaper_verdict import argo_workflow, as_read

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
UID = "uid-victim"


def run(name: str = "victim", uid: str = UID, namespace: str = "team-a") -> RunRef:
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=namespace, name=name, uid=uid, phase="Succeeded", finished_at=NOW,
    )  # fmt: skip


def stored(r: RunRef) -> PendingSchedule:
    due = CleanupDue(
        run=r, target=Target.KUBERNETES, deadline=NOW, policy="annotation", scheduled_at=NOW
    )
    return PendingSchedule(Target.KUBERNETES, r.uid, NOW + timedelta(hours=1), due=due)


def read(name: str, uid: str) -> dict[str, Any]:
    return as_read(argo_workflow(name, finished_at=NOW), uid=uid)


# --- where_to_read, judge_deletion ------------------------------------------------------


def test_the_object_is_read_where_lapse_stored_it_not_where_the_claim_says() -> None:
    assert where_to_read(UID, stored(run()), run("decoy")) == run()


def test_with_nothing_stored_the_claims_own_object_is_read() -> None:
    assert where_to_read(UID, None, run("decoy")) == run("decoy")
    assert where_to_read(UID, None, None) is None


@pytest.mark.parametrize(
    "schedule",
    [
        PendingSchedule(Target.KUBERNETES, UID, NOW),  # content not readable back
        stored(run(uid="another")),  # content of another uid
    ],
)
def test_a_stored_schedule_that_does_not_say_where_refuses(schedule: PendingSchedule) -> None:
    found = where_to_read(UID, schedule, run("decoy"))
    assert isinstance(found, Refusal) and f"uid {UID}" in found.reason


def test_gone_or_another_uid_under_the_name_confirms_the_deletion() -> None:
    assert judge_deletion(UID, run(), run(), None) is None
    assert judge_deletion(UID, run(), run(), read("victim", "a-successor")) is None


def test_the_same_uid_still_there_refuses_naming_both_names() -> None:
    same = judge_deletion(UID, run(), run(), read("victim", UID))
    assert same == Refusal(f"Workflow team-a/victim (uid {UID}) still exists")
    moved = judge_deletion(UID, run(), run("decoy", namespace="team-b"), read("victim", UID))
    assert isinstance(moved, Refusal)
    assert moved.reason == (
        f"Workflow team-a/victim (uid {UID}) still exists "
        "(the claim named team-b/decoy, lapse stored it as team-a/victim)"
    )


def test_an_answer_without_a_uid_confirms_nothing() -> None:
    body = read("victim", UID)
    del body["metadata"]["uid"]
    refusal = judge_deletion(UID, run(), run(), body)
    assert isinstance(refusal, Refusal) and "names no uid" in refusal.reason


# --- Planner.handle -----------------------------------------------------------------------


class Objects:
    """What the API server holds, by (namespace, name); each read is recorded."""

    def __init__(self, *objects: dict[str, Any], failure: Exception | None = None) -> None:
        self.objects = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects}
        self.failure = failure
        self.reads: list[tuple[str, str]] = []

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        self.reads.append((namespace, name))
        if self.failure is not None:
            raise self.failure
        return self.objects.get((namespace, name))


class Emitted:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def emit(self, event: BaseCloudEvent) -> None:
        self.events.append(event)


def planner(objects: Objects, *pending: RunRef) -> tuple[Planner, FakeSchedules]:
    schedules = FakeSchedules()
    for r in pending:
        schedules.stored[(Target.KUBERNETES, r.uid)] = stored(r)
    return Planner(schedules, Emitted(), fetcher=objects, clock=lambda: NOW), schedules


def deleted(r: RunRef) -> BaseCloudEvent:
    return build_event(EventType.RUN_DELETED, source="/forged", data=RunDeleted(run=r))


def ref_delete(name: str, uid: str | None = None) -> BaseCloudEvent:
    data = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "namespace": "team-a"}
    data["name"] = name
    if uid is not None:
        data["uid"] = uid
    attributes = {"type": "dev.knative.apiserver.ref.delete", "source": "/k", "id": "r-1"}
    return CloudEvent(attributes=attributes, data=data)


async def test_a_claim_under_another_name_is_refused_from_the_stored_name() -> None:
    objects = Objects(read("victim", UID))
    plan, schedules = planner(objects, run())
    [event] = await plan.handle(deleted(run("decoy")))
    failed = parse_payload(event, CleanupFailed)
    assert failed.stage == "planner" and failed.run == run()
    assert failed.reason.startswith("refused: ") and "no schedule was withdrawn" in failed.reason
    assert objects.reads == [("team-a", "victim")]
    assert (Target.KUBERNETES, UID) in schedules.stored


async def test_a_failed_read_withdraws_nothing_and_asks_again() -> None:
    objects = Objects(failure=ConnectionError("apiserver unreachable"))
    plan, schedules = planner(objects, run())
    with pytest.raises(ConnectionError):
        await plan.handle(deleted(run()))
    assert (Target.KUBERNETES, UID) in schedules.stored


async def test_the_watchers_own_deletion_is_believed_without_a_read() -> None:
    objects = Objects(read("victim", UID))
    plan, schedules = planner(objects, run())
    [event] = await plan.handle(deleted(run()), Trust.OBSERVED)
    assert parse_payload(event, CleanupCancelled).run == run()
    assert objects.reads == [] and schedules.stored == {}


async def test_a_reference_delete_of_an_object_that_exists_is_refused() -> None:
    plan, schedules = planner(Objects(read("victim", UID)), run())
    [event] = await plan.handle(ref_delete("victim"))
    assert "still exists" in parse_payload(event, CleanupFailed).reason
    assert (Target.KUBERNETES, UID) in schedules.stored


async def test_a_reference_delete_without_a_uid_of_a_gone_object_withdraws_nothing() -> None:
    plan, schedules = planner(Objects(), run())
    assert await plan.handle(ref_delete("victim")) == []
    assert (Target.KUBERNETES, UID) in schedules.stored


async def test_a_reference_delete_with_a_uid_is_confirmed_where_lapse_stored_it() -> None:
    # The uid is gone from the stored name, which holds a successor now: withdrawn.
    objects = Objects(read("victim", "a-successor"))
    plan, schedules = planner(objects, run())
    [event] = await plan.handle(ref_delete("elsewhere", uid=UID))
    assert parse_payload(event, CleanupCancelled).run == run()
    assert objects.reads == [("team-a", "elsewhere"), ("team-a", "victim")]
    assert schedules.stored == {}
    # Still there under the stored name: refused, whatever name the reference gave.
    plan, schedules = planner(Objects(read("victim", UID)), run())
    [event] = await plan.handle(ref_delete("elsewhere", uid=UID))
    assert "still exists" in parse_payload(event, CleanupFailed).reason
    assert (Target.KUBERNETES, UID) in schedules.stored
