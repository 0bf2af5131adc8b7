"""Repairing a failed deletion, as an operator does it: a reaper without `delete` permission
fails loudly (403, dead-lettered); the admin grants it (a namespaced Role and RoleBinding);
then `lapse dlq replay`, or separately `lapse reconcile`, deletes the Workflow exactly once.

Real kube-apiserver (RBAC on, the `lapse-readonly` token user), real NATS (the scheduler
fires the due message), the real dispatcher and handlers, and the CLI as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lapse.config import NatsConfig, Streams
from lapse.edges.kubernetes import Workflows, load_api_client
from lapse.edges.kubernetes.reaping import ReapedObjects
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore, subject_matches
from lapse.embedded.kube import READONLY_USER
from lapse.embedded.nats import EmbeddedNats
from lapse.events.adapters import adapt_workflow
from lapse.events.builder import build_event, parse_payload
from lapse.events.kinds import KindSpec
from lapse.events.models import CleanupCompleted, CleanupDue, RunFinished
from lapse.events.run import Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper import ObjectReaper
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Provenance, Trust
from lapse.functions.ttl_planner import Planner
from lapse.operations.audit import audit_events
from lapse.operations.dlq import Filter, dead_letters
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.routing import load_routes
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]

STREAMS = Streams()


def lapse(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lapse.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("LAPSE_")},
    )


@dataclass
class CountingWorkflows:
    """Pass-through to the real API server as `lapse-readonly`, counting DELETE requests
    and the ones the server accepted (no behaviour changed)."""

    inner: Workflows
    delete_requests: int = 0
    deleted: int = 0

    async def get(
        self, kind: KindSpec, namespace: str, name: str, *, request_timeout: float | None = None
    ) -> dict[str, Any] | None:
        return await ReapedObjects(self.inner.objects).get(
            kind, namespace, name, request_timeout=request_timeout
        )

    async def delete(self, kind: KindSpec, namespace: str, name: str, **kwargs: Any) -> None:
        self.delete_requests += 1
        await ReapedObjects(self.inner.objects).delete(kind, namespace, name, **kwargs)
        self.deleted += 1

    async def list_items(
        self, kind: KindSpec, namespace: str, **kwargs: Any
    ) -> list[dict[str, Any]]:
        return await ReapedObjects(self.inner.objects).list_items(kind, namespace, **kwargs)


@pytest.fixture
def readonly(kube: KubeStack, tmp_path: Path) -> Iterator[Workflows]:
    """Workflows as `lapse-readonly`, allowed get/list/watch (cluster-wide), not delete."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    name = f"lapse-repair-test-read-{uuid.uuid4().hex[:6]}"
    rule = client.V1PolicyRule(
        api_groups=["argoproj.io"], resources=["workflows"], verbs=["get", "list", "watch"]
    )
    rbac.create_cluster_role(
        client.V1ClusterRole(metadata=client.V1ObjectMeta(name=name), rules=[rule])
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
            ),
            subjects=[_readonly_subject()],
        )
    )
    path = tmp_path / "readonly.kubeconfig"
    path.write_text(
        yaml.safe_dump(kube.server.kubeconfig(kube.server.readonly_token, user=READONLY_USER))
    )
    api_client = load_api_client(str(path))
    yield Workflows(api_client, kube.executor)
    api_client.close()
    rbac.delete_cluster_role_binding(name)
    rbac.delete_cluster_role(name)


def _readonly_subject() -> client.RbacV1Subject:
    return client.RbacV1Subject(
        kind="User", name=READONLY_USER, api_group="rbac.authorization.k8s.io"
    )


def _allowed(kube: KubeStack, namespace: str, verb: str) -> bool:
    review = client.AuthorizationV1Api(kube.api_client).create_subject_access_review(
        client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=READONLY_USER,
                resource_attributes=client.V1ResourceAttributes(
                    group="argoproj.io", resource="workflows", verb=verb, namespace=namespace
                ),
            )
        )
    )
    return bool(review.status.allowed)


async def grant_delete(kube: KubeStack, namespace: str) -> None:
    """What the admin does to fix it: a Role with `delete` in the namespace, bound to the
    reaper's user; returns once the authorizer says yes."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    rule = client.V1PolicyRule(
        api_groups=["argoproj.io"], resources=["workflows"], verbs=["delete"]
    )
    rbac.create_namespaced_role(
        namespace, client.V1Role(metadata=client.V1ObjectMeta(name="lapse-delete"), rules=[rule])
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="lapse-delete"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="lapse-delete"
            ),
            subjects=[_readonly_subject()],
        ),
    )

    async def allowed() -> bool:
        return await asyncio.to_thread(_allowed, kube, namespace, "delete")

    await wait_for(allowed, timeout=30, interval=0.2)


@dataclass
class Stack:
    js: JetStreamContext
    kube: KubeStack
    workflows: CountingWorkflows
    planner: Planner
    config_path: Path
    namespace: str

    async def finished(self, name: str) -> dict[str, Any]:
        """A Workflow finished 20 minutes ago with a 1 s TTL: its deadline is long past."""
        body = argo_workflow(
            name,
            namespace=self.namespace,
            finished_at=datetime.now(UTC) - timedelta(minutes=20),
            annotations={"lapse.dev/ttl": "1s"},
        )
        return await self.kube.workflows.create(self.namespace, body)

    async def plan(self, obj: dict[str, Any]) -> None:
        finished = adapt_workflow(obj)
        assert isinstance(finished, RunFinished)
        # As the watcher plans it: a version lapse read itself.
        await self.planner.handle(
            build_event(EventType.RUN_FINISHED, source="/test", data=finished), Trust.OBSERVED
        )

    async def exists(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        current = await self.kube.workflows.get(meta["namespace"], meta["name"])
        return current is not None and current["metadata"]["uid"] == meta["uid"]

    async def dead(self) -> list[dict[str, Any]]:
        return [
            letter.row()
            async for letter in dead_letters(self.js, STREAMS.dlq, Filter(namespace=self.namespace))
        ]

    async def outcomes(self, uid: str) -> list[Outcome]:
        found = []
        async for event in audit_events(
            self.js, STREAMS.audit, event_type=EventType.CLEANUP_COMPLETED
        ):
            payload = parse_payload(event, CleanupCompleted)
            if payload.run.uid == uid:
                found.append(payload.outcome)
        return found


@pytest.fixture
async def stack(
    kube: KubeStack,
    nats_server: EmbeddedNats,
    lapse_streams: JetStreamContext,
    readonly: Workflows,
    tmp_path: Path,
) -> AsyncIterator[Stack]:
    """The object reaper behind the real dispatcher, as `lapse-readonly`."""
    js = lapse_streams
    namespace = kube.namespace(f"repair-{uuid.uuid4().hex[:6]}")
    counting = CountingWorkflows(readonly)
    schedules = NatsScheduleStore(js, STREAMS)
    emitter = NatsEmitter(js, STREAMS)
    reaper = ObjectReaper(
        objects=counting,
        schedules=schedules,
        emitter=emitter,
        safety=SafetyConfig(),
        request_timeout=10,
    )
    route = next(r for r in load_routes() if r.name == "object-reaper-due")
    dispatcher = Dispatcher(js, emitter, NatsConfig(), [Subscription(route, reaper)])
    running = asyncio.create_task(dispatcher.run())
    config_path = tmp_path / "lapse.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "nats": {"url": nats_server.url},
                "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
            }
        )
    )
    try:
        yield Stack(
            js,
            kube,
            counting,
            Planner(schedules=schedules, emitter=emitter),
            config_path,
            namespace,
        )
    finally:
        dispatcher.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
        custom = client.CustomObjectsApi(kube.api_client)
        custom.delete_collection_namespaced_custom_object(
            "argoproj.io", "v1alpha1", namespace, "workflows"
        )


async def refused(stack: Stack, name: str) -> dict[str, Any]:
    """A Workflow whose deletion the reaper tried and the API server refused (403)."""

    async def can_read() -> bool:
        return await asyncio.to_thread(_allowed, stack.kube, stack.namespace, "get")

    await wait_for(can_read, timeout=30, interval=0.2)
    wf = await stack.finished(name)
    await stack.plan(wf)

    async def dead_lettered() -> bool:
        return len(await stack.dead()) == 1

    await wait_for(dead_lettered, timeout=30, interval=0.2)
    [letter] = await stack.dead()
    assert letter["stage"] == "object-reaper"
    assert letter["uid"] == wf["metadata"]["uid"] and letter["target"] == "kubernetes"
    assert letter["reason"].startswith("forbidden: ")
    assert await stack.exists(wf)
    assert (stack.workflows.delete_requests, stack.workflows.deleted) == (1, 0)
    return wf


async def deleted_once(stack: Stack, wf: dict[str, Any]) -> None:
    async def gone() -> bool:
        return not await stack.exists(wf)

    await wait_for(gone, timeout=30, interval=0.2)
    # Anything else still in flight (a second due event) would show up within this time.
    await asyncio.sleep(2)
    assert stack.workflows.deleted == 1
    assert await stack.outcomes(wf["metadata"]["uid"]) == [Outcome.DELETED]


async def test_dlq_replay_deletes_a_repaired_refusal_once(stack: Stack) -> None:
    wf = await refused(stack, "refused-then-replayed")
    await grant_delete(stack.kube, stack.namespace)

    listed = lapse("--config", str(stack.config_path), "dlq", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)["items"]
    assert row["name"] == "refused-then-replayed" and "cannot delete" in row["reason"]

    shown = lapse("--config", str(stack.config_path), "dlq", "show", str(row["id"]))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["replayProblem"] is None

    # Purge and replay refuse to guess what they should act on.
    vague = lapse("--config", str(stack.config_path), "dlq", "replay")
    assert vague.returncode == 2 and "--all" in vague.stderr

    dry = lapse(
        "--config", str(stack.config_path), "dlq", "replay", "-n", stack.namespace, "--dry-run"
    )
    assert dry.returncode == 0, dry.stderr
    assert len(await stack.dead()) == 1 and await stack.exists(wf)

    replayed = lapse(
        "--config", str(stack.config_path), "dlq", "replay", "-n", stack.namespace, "-o", "json"
    )
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert [r["subject"] for r in report["replayed"]] == [
        due_subject(Target.KUBERNETES, wf["metadata"]["uid"])
    ]
    assert report["removed"] == [row["id"]] and report["left"] == []
    await deleted_once(stack, wf)
    assert await stack.dead() == []

    # Replaying again finds nothing: the entry is gone, nothing is deleted twice.
    again = lapse("--config", str(stack.config_path), "dlq", "replay", "--all", "-o", "json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["replayed"] == []
    await asyncio.sleep(1)
    assert stack.workflows.deleted == 1


async def test_reconcile_deletes_a_repaired_refusal_once(stack: Stack) -> None:
    wf = await refused(stack, "refused-then-reconciled")
    uid = wf["metadata"]["uid"]
    # The watcher's planner still sees the fired deadline: a re-list issues nothing new.
    pending = await NatsScheduleStore(stack.js, STREAMS).get(Target.KUBERNETES, uid)
    assert pending is not None
    await grant_delete(stack.kube, stack.namespace)

    result = lapse(
        "--config", str(stack.config_path), "reconcile", "-n", stack.namespace, "-o", "json"
    )
    assert result.returncode == 0, result.stderr
    await deleted_once(stack, wf)
    # The dead letter stays (nothing replayed it): the operator sees what had failed.
    assert len(await stack.dead()) == 1


async def test_a_due_message_in_hand_is_not_issued_again(
    lapse_streams: JetStreamContext,
) -> None:
    """What "handled" means to reconcile: acknowledged by every durable consumer of the
    due subject. Before that (nobody has taken it, or it is delivered and not acked) the
    deadline counts as scheduled, so reconcile does not issue a duplicate."""
    js = lapse_streams
    uid = str(uuid.uuid4())
    default = NatsScheduleStore(js, STREAMS)
    rederive = NatsScheduleStore(js, STREAMS, rederive_handled=True)
    obj = argo_workflow("in-hand", finished_at=datetime.now(UTC) - timedelta(hours=1))
    obj["metadata"]["uid"] = uid
    finished = adapt_workflow(obj)
    assert isinstance(finished, RunFinished)
    deadline = datetime.now(UTC) - timedelta(minutes=5)
    due = CleanupDue(
        run=finished.run,
        target=Target.KUBERNETES,
        deadline=deadline.replace(microsecond=0),
        policy="test",
        scheduled_at=datetime.now(UTC),
    )
    await default.put(
        Target.KUBERNETES,
        uid,
        due.deadline,
        build_event(EventType.CLEANUP_DUE, source="/test", data=due),
        provenance=Provenance.CLAIMED,
    )
    subject = due_subject(Target.KUBERNETES, uid)

    async def fired() -> bool:
        try:
            await js.get_last_msg(STREAMS.schedule, subject)
        except Exception:
            return False
        return True

    await wait_for(fired, timeout=15, interval=0.1)
    # No consumer has taken it: it waits for one.
    assert (await rederive.get(Target.KUBERNETES, uid)) is not None
    sub = await js.pull_subscribe(
        subject,
        durable=f"reaper-{uid[:8]}",
        stream=STREAMS.schedule,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=60
        ),
    )
    [msg] = await sub.fetch(1, timeout=5)
    await asyncio.sleep(1.1)  # past the store's consumer snapshot
    held = await rederive.get(Target.KUBERNETES, uid)
    assert held is not None and held.deadline == due.deadline
    await msg.ack_sync()
    await asyncio.sleep(1.1)
    assert await rederive.get(Target.KUBERNETES, uid) is None
    assert (await default.get(Target.KUBERNETES, uid)) is not None
    await sub.unsubscribe()
    await js.delete_consumer(STREAMS.schedule, f"reaper-{uid[:8]}")


def test_subject_matching() -> None:
    assert subject_matches("lapse.due.kubernetes.>", "lapse.due.kubernetes.abc")
    assert subject_matches("lapse.due.*.abc", "lapse.due.database.abc")
    assert not subject_matches("lapse.due.database.>", "lapse.due.kubernetes.abc")
    assert not subject_matches("lapse.due.kubernetes.>", "lapse.due.kubernetes")
    assert not subject_matches("lapse.due.*", "lapse.due.kubernetes.abc")
