"""Policy objects through `lapse up` (a subprocess) on real NATS and kube-apiserver: a
LapsePolicy created, edited and deleted moves a pending run's deadline both ways within
seconds, with no restart; a deadline moved into the past fires at once; `lapse plan` and
`lapse history` name the policy object and its generation."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.run import Target
from lapse.events.timeutil import format_rfc3339
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.stack import wait_for

GROUP, VERSION = "lapse.dev", "v1alpha1"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: policy objects are cluster-wide state.
    with kube_stack(tmp_path_factory.mktemp("kube-policies")) as stack:
        yield stack


def workflow(name: str, finished_at: datetime) -> dict[str, Any]:
    stamp = format_rfc3339(finished_at)
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": {"workflows.argoproj.io/completed": "true"}},
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Succeeded", "startedAt": stamp, "finishedAt": stamp},
    }


async def test_a_policy_object_moves_deadlines_both_ways_without_a_restart(
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
        "metadata": {"name": "teams"},
        "spec": {"match": {"namespaces": ["team-*"]},
                 "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "1m"}}},
    })  # fmt: skip
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    wf = await kube.workflows.create(ns, workflow("train", finished))
    uid = wf["metadata"]["uid"]
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    nc = await connect(own_nats.url)
    store = NatsScheduleStore(nc.jetstream(), Streams())

    async def deadline_is(expected: datetime) -> bool:
        pending = await store.get(Target.KUBERNETES, uid)
        return pending is not None and pending.deadline == expected

    def policy(ttl: str, name: str = "short") -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LapsePolicy",
                "metadata": {"name": name}, "spec": {"kubernetes": {"ttl": ttl}}}  # fmt: skip

    try:
        # Nothing but the built-in default at first: 24h after the finish.
        await wait_for(lambda: deadline_is(finished + timedelta(hours=24)), timeout=60)
        # Created: earlier.
        api.create_namespaced_custom_object(GROUP, VERSION, ns, "lapsepolicies", policy("2h"))
        await wait_for(lambda: deadline_is(finished + timedelta(hours=2)), timeout=15)
        plan = lapse_json("plan", "-n", ns, config=config)
        assert plan[0]["targets"]["kubernetes"]["policy"] == f"lapsepolicy:{ns}/short@1"
        # Previewed before it is applied: `lapse plan -f` with the edit, nothing changed.
        edit = tmp_path / "edit.yaml"
        edit.write_text(yaml.safe_dump(policy("3d")))
        seen = lapse_json("plan", "-n", ns, "-f", str(edit), "--policy", config=config)
        assert [r["name"] for r in seen] == ["train"]
        assert seen[0]["targets"]["kubernetes"]["policy"] == f"lapsepolicy:{ns}/short@2"
        assert seen[0]["targets"]["kubernetes"]["deadline"] == format_rfc3339(
            finished + timedelta(days=3)
        )
        assert await deadline_is(finished + timedelta(hours=2))  # a preview changes nothing
        # Edited: later (a new generation names it).
        api.patch_namespaced_custom_object(
            GROUP, VERSION, ns, "lapsepolicies", "short", {"spec": {"kubernetes": {"ttl": "3d"}}}
        )
        await wait_for(lambda: deadline_is(finished + timedelta(days=3)), timeout=15)
        # Deleted: back to the default.
        api.delete_namespaced_custom_object(GROUP, VERSION, ns, "lapsepolicies", "short")
        await wait_for(lambda: deadline_is(finished + timedelta(hours=24)), timeout=15)
        # A deadline moved into the past fires now: the run is deleted within seconds.
        api.create_namespaced_custom_object(
            GROUP, VERSION, ns, "lapsepolicies", policy("5m", "now")
        )

        async def deleted() -> bool:
            return await kube.workflows.get(ns, "train") is None

        await wait_for(deleted, timeout=30)
        history = lapse_json("history", "-n", ns, "--all", config=config)
        scheduled = [r["detail"] for r in history if r["event"] == "cleanup.scheduled"]
        assert f"lapsepolicy:{ns}/short@1" in scheduled
        assert f"lapsepolicy:{ns}/short@2" in scheduled
        assert "default" in scheduled
        done = [r for r in history if r["outcome"] == "deleted"]
        assert len(done) == 1 and f"lapsepolicy:{ns}/now@1" in done[0]["detail"], done
    finally:
        await nc.close()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
    log = (tmp_path / "up.log").read_text()
    assert log.count("policy objects read") == 1  # one start: no restart did any of it
