"""Floors hold through `lapse up` (a subprocess) on real NATS and kube-apiserver with the
policy CRDs: a ClusterLapsePolicy's Kubernetes `minTTL` bounds a LapsePolicy's `keepLast`,
in the planner's count and in the object reaper's recount.

The finding (issue 36), as it was set up: `minTTL: 1h`; a LapsePolicy `ttl: 1m` with
`keepLast: {total: 1}`; the status said "clamped to the minimum 1h", and the older run of
the group was deleted 3 s after it finished. The CRD refuses TTLs under 1m, so the floor is
the realistic hour and the test reads the deadline lapse stored instead of waiting it out:
no deadline before finish + 1h, and nothing deleted once the group was counted."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.adapters import adapt_workflow
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue, RunFinished
from lapse.events.run import Target
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType
from lapse.functions.trust import Provenance
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_keep_last import drained
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

GROUP, VERSION = "lapse.dev", "v1alpha1"
CRON = "workflows.argoproj.io/cron-workflow"
HOUR = timedelta(hours=1)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: policy objects are cluster-wide state.
    with kube_stack(tmp_path_factory.mktemp("kube-floors")) as stack:
        yield stack


def workflow(name: str, group: str, finished: datetime) -> dict[str, Any]:
    stamp = format_rfc3339(finished)
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true", CRON: group},
        },
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Succeeded", "startedAt": stamp, "finishedAt": stamp},
    }


def lapse_policy(name: str, group: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "LapsePolicy", "metadata": {"name": name},
        "spec": {"match": {"labels": {CRON: group}}, **spec},
    }  # fmt: skip


async def test_a_count_never_deletes_before_the_admins_floor(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "safety: {max_deletions_per_second: 200, namespaces: {include: ['*']}}\n"
    )
    ns = kube.namespace(f"team-{uuid.uuid4().hex[:6]}")
    api = client.CustomObjectsApi(kube.api_client)
    api.create_cluster_custom_object(GROUP, VERSION, "clusterlapsepolicies", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterLapsePolicy",
        "metadata": {"name": "platform"},
        "spec": {"match": {"namespaces": [ns]},
                 "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "1h"}}},
    })  # fmt: skip
    # The finding's policy, and one that only counts (its runs' clock is the built-in 24h,
    # so the count's floored deadline is what lapse stores: the count is seen to happen).
    finding = lapse_policy("finding", "finding", {"kubernetes": {"ttl": "1m"},
                                                  "keepLast": {"total": 1}})  # fmt: skip
    counting = lapse_policy("counting", "counting", {"keepLast": {"total": 1}})
    for body in (finding, counting):
        api.create_namespaced_custom_object(GROUP, VERSION, ns, "lapsepolicies", body)

    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    nc = await connect(own_nats.url)
    store = NatsScheduleStore(nc.jetstream(), Streams())

    async def deadline_of(uid: str) -> datetime | None:
        pending = await store.get(Target.KUBERNETES, uid)
        return None if pending is None else pending.deadline

    async def create(name: str, group: str, ago: int = 0) -> tuple[dict[str, Any], datetime]:
        # Finish times a few seconds apart: the count ranks by them (a tie by name).
        finished = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=ago)
        return await kube.workflows.create(ns, workflow(name, group, finished)), finished

    def condition(name: str) -> dict[str, Any]:
        obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, "lapsepolicies", name)
        found = [c for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == "Accepted"]  # fmt: skip
        return found[0] if found else {}

    try:
        # The status names each clause clamped, and by whom.
        floor_note = (
            "keepLast: a run it counts out is kept at least the minimum 1h after it "
            "finished (clusterlapsepolicy:platform@1)"
        )

        async def stated() -> bool:
            notes = [condition(name).get("message", "") for name in ("finding", "counting")]
            return all(floor_note in note for note in notes)

        await wait_for(stated, timeout=30)
        assert condition("finding")["reason"] == "Clamped"
        assert "kubernetes.ttl 1m clamped to the minimum 1h" in condition("finding")["message"]

        # The finding: the older run finishes, then a newer one of its group.
        old, old_finished = await create("finding-old", "finding", ago=3)
        old_uid = old["metadata"]["uid"]
        await wait_for(lambda: _is(deadline_of(old_uid), old_finished + HOUR), timeout=30)
        new, new_finished = await create("finding-new", "finding")
        new_uid = new["metadata"]["uid"]
        await wait_for(lambda: _is(deadline_of(new_uid), new_finished + HOUR), timeout=30)
        # The count of the group was made before the newer run's own schedule was put:
        # it left the older run's deadline where its clamped TTL put it.
        assert await deadline_of(old_uid) == old_finished + HOUR
        assert await kube.workflows.get(ns, "finding-old") is not None

        # A count alone: the older run is counted out, due at its own finish + 1h.
        counted, counted_finished = await create("counting-old", "counting", ago=3)
        counted_uid = counted["metadata"]["uid"]
        await wait_for(
            lambda: _is(deadline_of(counted_uid), counted_finished + timedelta(hours=24)),
            timeout=30,
        )
        await create("counting-new", "counting")
        await wait_for(lambda: _is(deadline_of(counted_uid), counted_finished + HOUR), timeout=30)

        # The reaper's recount holds the floor too: a schedule due now for the counted-out
        # run (as a count made without the floor put it) is rescheduled, not deleted.
        read = adapt_workflow(await kube.workflows.get(ns, "counting-old"))
        assert isinstance(read, RunFinished)
        now = datetime.now(UTC)
        due = CleanupDue(
            run=read.run, target=Target.KUBERNETES, deadline=now, scheduled_at=now,
            policy=f"keep_last:lapsepolicy:{ns}/counting@1",
        )  # fmt: skip
        event = build_event(EventType.CLEANUP_DUE, source="/test", data=due)
        await store.put(Target.KUBERNETES, counted_uid, now, event, provenance=Provenance.CLAIMED)

        def outcomes() -> list[dict[str, Any]]:
            rows = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
            return [r for r in rows if r["outcome"]]

        async def rescheduled() -> bool:
            return any(
                r["outcome"] == "rescheduled" and r["name"] == "counting-old" for r in outcomes()
            )

        await wait_for(rescheduled, timeout=30)
        await wait_for(lambda: _is(deadline_of(counted_uid), counted_finished + HOUR), timeout=15)
        await wait_for(lambda: drained(own_nats.url), timeout=30)
        left = {w["metadata"]["name"] for w in (await kube.workflows.list(ns))["items"]}
        assert left == {"finding-old", "finding-new", "counting-old", "counting-new"}
        history = outcomes()
        assert not [r for r in history if r["outcome"] == "deleted"], history
        detail = next(r["detail"] for r in history if r["name"] == "counting-old")
        assert "kept at least the minimum 1h" in detail, detail
    finally:
        await nc.close()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


async def _is(value: Any, expected: datetime) -> bool:
    return bool(await value == expected)
