"""Policy objects on a real kube-apiserver: the shipped CRDs refuse what their schema and CEL
rules can say; the policy watcher judges the rest (status conditions: accepted, clamped,
refused), keeps the book current and re-plans the runs of a changed policy's namespace;
the tenants' role reaches only its own namespace (SubjectAccessReview)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import to_binary_event
from func_python.cloudevent import ASGIApplication
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext

from lapse import infra
from lapse.config import Streams, load_config
from lapse.edges.kubernetes import KubeObjects
from lapse.edges.kubernetes.policies import namespace_names
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event, parse_payload
from lapse.events.kinds import DEFAULT_KINDS
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupScheduled, RunFinished
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper.function import new as new_object_reaper
from lapse.functions.policy_objects import PolicyBook
from lapse.functions.ttl_planner.function import new as new_planner
from lapse.operations.audit import audit_events
from lapse.runtime.policy_watcher import PolicyWatcher, serve
from tests.conftest import KubeStack
from tests.e2e.test_lapse_up import finished_workflow
from tests.infra_package import kubectl
from tests.integration.test_rbac import may
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow

pytestmark = [pytest.mark.kube]

GROUP, VERSION = "lapse.dev", "v1alpha1"


def lapse_policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LapsePolicy",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def cluster_policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterLapsePolicy",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def create(kube: KubeStack, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
    api = client.CustomObjectsApi(kube.api_client)
    if namespace is None:
        created: dict[str, Any] = api.create_cluster_custom_object(
            GROUP, VERSION, "clusterlapsepolicies", body, field_validation="Strict"
        )
    else:
        created = api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "lapsepolicies", body, field_validation="Strict"
        )
    return created


def refusal(kube: KubeStack, namespace: str | None, body: dict[str, Any], status: int = 422) -> str:
    with pytest.raises(ApiException) as refused:
        create(kube, namespace, body)
    assert refused.value.status == status, refused.value.body
    return str(refused.value.body)


def test_the_api_server_refuses_what_the_schema_can_say(kube: KubeStack) -> None:
    ns = kube.namespace(f"pol-{uuid.uuid4().hex[:6]}")
    ok = create(kube, ns, lapse_policy("ok", {"kubernetes": {"ttl": "1d12h"}}))
    assert ok["metadata"]["generation"] == 1
    # Below the fixed 1m minimum (any spelling of it), malformed durations, no clock.
    for ttl in ("30s", "0m59s", "0h"):
        body = refusal(kube, ns, lapse_policy("short", {"kubernetes": {"ttl": ttl}}))
        assert "at least 1m" in body, body
    for ttl in ("1.5h", "12", "5x", "-1h", "h"):
        refusal(kube, ns, lapse_policy("bad", {"database": {"ttl": ttl}}))
    assert "at least one of" in refusal(kube, ns, lapse_policy("empty", {}))
    assert "afterSuccess" in refusal(kube, ns, lapse_policy("none", {"kubernetes": {}}))
    # A LapsePolicy has no way to name another namespace: the field does not exist.
    smuggled = lapse_policy("other", {"match": {"namespaces": ["*"]}, "kubernetes": {"ttl": "1h"}})
    assert 'unknown field \\"spec.match.namespaces\\"' in refusal(kube, ns, smuggled, 400)
    # Without strict field validation (a client that does not ask for it) it is dropped.
    kept = client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        GROUP, VERSION, ns, "lapsepolicies", smuggled
    )
    assert "namespaces" not in kept["spec"]["match"]
    keep_both = {"keepLast": {"groupBy": "label:app", "total": 3, "succeeded": 1}}
    assert "not both" in refusal(kube, ns, lapse_policy("keep", keep_both))
    # The cluster policy's own bounds must make sense: minTTL above maxTTL is refused.
    inverted = {
        "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "2d", "maxTTL": "1d12h"}}
    }
    assert "minTTL is longer than maxTTL" in refusal(kube, None, cluster_policy("inv", inverted))
    fine = {"namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "1w", "maxTTL": "8d"}}}
    created = create(kube, None, cluster_policy(f"fine-{ns}", fine))
    client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(
        GROUP, VERSION, "clusterlapsepolicies", created["metadata"]["name"]
    )


class Published:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def publish(self, event: BaseCloudEvent) -> None:
        self.events.append(event)

    def names(self) -> set[str]:
        names = set()
        for event in self.events:
            payload = parse_payload(event)
            assert isinstance(payload, RunFinished)
            names.add(f"{payload.run.namespace}/{payload.run.name}")
        return names


@contextlib.asynccontextmanager
async def watching(kube: KubeStack, published: Published) -> AsyncIterator[PolicyWatcher]:
    objects = KubeObjects(kube.api_client, kube.executor, DEFAULT_KINDS)
    watcher = PolicyWatcher(
        objects, PolicyBook(), DEFAULT_KINDS, published.publish,
        lambda: namespace_names(kube.api_client, kube.executor),
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await wait_for(watcher.synced.wait, timeout=30)
    try:
        yield watcher
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


def condition(kube: KubeStack, namespace: str, name: str) -> dict[str, Any] | None:
    obj = client.CustomObjectsApi(kube.api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "lapsepolicies", name
    )
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    found: dict[str, Any] = status["conditions"][0]
    return found


async def test_the_watcher_judges_clamps_and_replans_only_the_policys_namespace(
    kube: KubeStack,
) -> None:
    tag = uuid.uuid4().hex[:6]
    team, other = kube.namespace(f"pol-a-{tag}"), kube.namespace(f"pol-b-{tag}")
    for ns in (team, other):
        await kube.workflows.create(ns, finished_workflow("done"))
    published = Published()
    api = client.CustomObjectsApi(kube.api_client)
    bounds = cluster_policy(f"bounds-{tag}", {
        "match": {"namespaces": [f"pol-a-{tag}"]},
        "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "1h", "maxTTL": "7d"}},
    })  # fmt: skip
    async with watching(kube, published) as watcher:
        # No ClusterLapsePolicy allows it yet: refused, and it says why.
        create(kube, team, lapse_policy("short", {"kubernetes": {"ttl": "5m"}}))

        async def refused() -> dict[str, Any] | None:
            return condition(kube, team, "short")

        first = await wait_for(refused, timeout=15)
        assert first is not None
        assert (first["status"], first["reason"]) == ("False", "NotAllowed"), first
        assert f"namespace {team}" in first["message"]
        # The bounds arrive: the same object is now in effect, clamped, and says so.
        create(kube, None, bounds)

        async def clamped() -> dict[str, Any] | None:
            found = condition(kube, team, "short")
            return found if found and found["reason"] == "Clamped" else None

        now = await wait_for(clamped, timeout=15)
        assert now is not None
        assert now["status"] == "True"
        assert "kubernetes.ttl 5m clamped to the minimum 1h" in now["message"]
        assert f"clusterlapsepolicy:bounds-{tag}@1" in now["message"]
        labels = [p.label for p in watcher._book]
        assert f"lapsepolicy:{team}/short@1" in labels
        # An edit moves the generation: the book names the new one, and only the policy's
        # own namespace was re-planned (the other namespace's run never published).
        before = len(published.events)
        api.patch_namespaced_custom_object(
            GROUP, VERSION, team, "lapsepolicies", "short", {"spec": {"kubernetes": {"ttl": "2h"}}}
        )

        async def edited() -> bool:
            return f"lapsepolicy:{team}/short@2" in [p.label for p in watcher._book]

        await wait_for(edited, timeout=15)
        await wait_for(lambda: _more(published, before), timeout=15)
        assert published.names() >= {f"{team}/done"}
        assert f"{other}/done" not in published.names()
        accepted = await wait_for(refused, timeout=15)
        assert accepted is not None
        assert accepted["reason"] == "Accepted", accepted
        # Deleted: gone from the book, and its namespace re-planned once more.
        before = len(published.events)
        api.delete_namespaced_custom_object(GROUP, VERSION, team, "lapsepolicies", "short")

        async def removed() -> bool:
            return all(not p.label.startswith(f"lapsepolicy:{team}/") for p in watcher._book)

        await wait_for(removed, timeout=15)
        await wait_for(lambda: _more(published, before), timeout=15)
        assert f"{other}/done" not in published.names()
    api.delete_cluster_custom_object(GROUP, VERSION, "clusterlapsepolicies", f"bounds-{tag}")


async def _more(published: Published, before: int) -> bool:
    return len(published.events) > before


def test_a_tenant_edits_policies_only_in_its_own_namespace(kube: KubeStack) -> None:
    rbac = yaml.safe_load_all(infra.read_text("crds/rbac.yaml"))
    out = subprocess.run(
        [str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side",
         "--field-manager=lapse-test", "-f", "-"],
        input=yaml.safe_dump_all(list(rbac)), capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tag = uuid.uuid4().hex[:6]
    mine, theirs = kube.namespace(f"ten-a-{tag}"), kube.namespace(f"ten-b-{tag}")
    client.RbacAuthorizationV1Api(kube.api_client).create_namespaced_role_binding(
        mine,
        {
            "metadata": {"name": "lapse-policy-editor"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "lapse-policy-editor"},
            "subjects": [{"kind": "ServiceAccount", "name": "ci", "namespace": mine}],
        },
    )  # fmt: skip
    policies = (GROUP, "lapsepolicies")

    def tenant(verb: str, resource: tuple[str, str], namespace: str | None) -> bool:
        return may(kube, "ci", verb, resource, namespace, account_namespace=mine)

    for verb in ("create", "update", "patch", "delete", "get", "list"):
        assert tenant(verb, policies, mine), verb
        assert not tenant(verb, policies, theirs), verb
    assert not tenant("list", policies, None)  # no cluster-wide view of others' policies
    assert not tenant("patch", (GROUP, "lapsepolicies/status"), mine)  # lapse's verdict
    for verb in ("create", "update", "delete"):
        assert not tenant(verb, (GROUP, "clusterlapsepolicies"), None), verb
    # lapse itself reads every policy and writes only status.
    lapse = "lapse"
    assert may(kube, lapse, "watch", policies, None)
    assert may(kube, lapse, "patch", (GROUP, "lapsepolicies/status"), mine)
    assert not may(kube, lapse, "update", policies, mine)
    assert not may(kube, lapse, "delete", (GROUP, "clusterlapsepolicies"), None)


class FailingOnce(Published):
    """Refuses the first publish: a stand-in for NATS being away for a moment (the real
    outage is provoked in tests/e2e/test_outages.py; here only the retry is the subject)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def publish(self, event: BaseCloudEvent) -> None:
        if not self.refused:
            self.refused += 1
            raise ConnectionError("nats: no servers available for connection")
        await super().publish(event)


async def test_a_replan_that_fails_is_tried_again(kube: KubeStack) -> None:
    tag = uuid.uuid4().hex[:6]
    team = kube.namespace(f"pol-r-{tag}")
    await kube.workflows.create(team, finished_workflow("done"))
    published = FailingOnce()
    allow = cluster_policy(f"allow-{tag}", {"match": {"namespaces": [team]},
                                            "namespacedPolicies": {"allowed": True}})  # fmt: skip
    create(kube, None, allow)
    try:
        async with watching(kube, published) as watcher:
            create(kube, team, lapse_policy("p", {"kubernetes": {"ttl": "2h"}}))

            # The counter moves after the publish returns (the next page is awaited in
            # between), so both are waited on together.
            async def republished() -> bool:
                return f"{team}/done" in published.names() and watcher.replanned >= 1

            await wait_for(republished, timeout=60)
            assert published.refused == 1
    finally:
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(
            GROUP, VERSION, "clusterlapsepolicies", f"allow-{tag}"
        )


# The Knative path (docs/policies.md, "On the Knative path"): the ttl-planner function, as
# Knative serves it (func-python's ASGI app, HTTP in), follows the policy objects itself;
# the Deployment lapse-policy-watcher (`serve`) writes their status and re-plans with a
# ttl-planner of its own, into the same NATS schedules.


def _allow(tag: str, namespace: str) -> dict[str, Any]:
    return cluster_policy(f"allow-{tag}", {"match": {"namespaces": [namespace]},
                                           "namespacedPolicies": {"allowed": True}})  # fmt: skip


async def _deadline(js: JetStreamContext, uid: str) -> datetime | None:
    pending = await NatsScheduleStore(js, Streams()).get(Target.KUBERNETES, uid)
    return None if pending is None else pending.deadline


async def _scheduled_by(js: JetStreamContext, uid: str) -> list[str]:
    """The policy each CleanupScheduled of `uid`'s object names, oldest first."""
    found = []
    async for event in audit_events(js, Streams().audit, event_type=EventType.CLEANUP_SCHEDULED):
        scheduled = parse_payload(event, CleanupScheduled)
        if scheduled.run.uid == uid and scheduled.target is Target.KUBERNETES:
            found.append(scheduled.policy)
    return found


async def test_the_knative_planner_function_plans_with_a_lapse_policy_and_follows_its_edits(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    """No restart, no watcher in the function's process but its own read-only follower: a
    run.finished over HTTP is planned with the LapsePolicy's TTL (not lapse.yaml's 24h
    default), named by the object; after an edit the same event moves the deadline."""
    tag = uuid.uuid4().hex[:6]
    ns = kube.namespace(f"pol-kn-{tag}")
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    wf = await kube.workflows.create(ns, argo_workflow("wf", namespace=ns, finished_at=finished))
    uid = wf["metadata"]["uid"]
    create(kube, None, _allow(tag, ns))
    create(kube, ns, lapse_policy("team", {"kubernetes": {"ttl": "3d"}}))
    function = new_planner()
    function.start(
        {"LAPSE_NATS__URL": nats_server.url, "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)}
    )
    try:
        await function.started()
        assert function.ready() == (True, "ready")
        run = RunRef(
            engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
            namespace=ns, name="wf", uid=uid, phase="Succeeded", finished_at=finished,
        )  # fmt: skip
        message = to_binary_event(
            build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
        )
        transport = httpx.ASGITransport(app=ASGIApplication(function))
        async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:

            async def post() -> None:
                answer = await http.post("/", headers=message.headers, content=message.body)
                assert answer.status_code == 202, answer.text

            await post()
            assert await _deadline(lapse_streams, uid) == finished + timedelta(days=3)
            assert await _scheduled_by(lapse_streams, uid) == [f"lapsepolicy:{ns}/team@1"]

            client.CustomObjectsApi(kube.api_client).patch_namespaced_custom_object(
                GROUP, VERSION, ns, "lapsepolicies", "team", {"spec": {"kubernetes": {"ttl": "5d"}}}
            )

            # The follower's watch brings the edit; until it has, the same event (the
            # Broker's redelivery, a re-list) leaves the deadline where it was.
            async def moved() -> bool:
                await post()
                return await _deadline(lapse_streams, uid) == finished + timedelta(days=5)

            await wait_for(moved, timeout=30)
            assert (await _scheduled_by(lapse_streams, uid))[-1] == f"lapsepolicy:{ns}/team@2"
    finally:
        function.stop()
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(
            GROUP, VERSION, "clusterlapsepolicies", f"allow-{tag}"
        )


async def test_the_knative_policy_watcher_writes_status_and_replans_into_the_schedules(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    """The Deployment lapse-policy-watcher's process (`python -m lapse.runtime.policy_watcher`
    runs `serve`): a LapsePolicy created after the run finished is judged (status Accepted)
    and moves the run's schedule by itself, with no event from the ApiServerSource."""
    tag = uuid.uuid4().hex[:6]
    ns = kube.namespace(f"pol-kw-{tag}")
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    wf = await kube.workflows.create(ns, argo_workflow("wf", namespace=ns, finished_at=finished))
    uid = wf["metadata"]["uid"]
    create(kube, None, _allow(tag, ns))
    config = load_config(
        None,
        env={"LAPSE_NATS__URL": nats_server.url,
             "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig)},
    )  # fmt: skip
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(config, stop))
    try:
        # Started, it re-plans what no lapse has judged yet: the ClusterLapsePolicy's
        # namespace, where the run gets lapse.yaml's default (no LapsePolicy yet).
        async def defaulted() -> bool:
            return await _deadline(lapse_streams, uid) == finished + timedelta(hours=24)

        await wait_for(defaulted, timeout=60)
        create(kube, ns, lapse_policy("team", {"kubernetes": {"ttl": "2d"}}))

        async def accepted() -> dict[str, Any] | None:
            found = condition(kube, ns, "team")
            return found if found and found["reason"] == "Accepted" else None

        verdict = await wait_for(accepted, timeout=30)
        assert verdict is not None and verdict["status"] == "True"

        async def replanned() -> bool:
            return await _deadline(lapse_streams, uid) == finished + timedelta(days=2)

        await wait_for(replanned, timeout=30)

        # The re-plan's audit record follows its schedule (stored first, then emitted).
        async def recorded() -> list[str] | None:
            found = await _scheduled_by(lapse_streams, uid)
            return found if len(found) >= 2 else None

        by = await wait_for(recorded, timeout=30)
        assert by == ["default", f"lapsepolicy:{ns}/team@1"]
        assert not serving.done()
    finally:
        stop.set()
        watcher = await asyncio.wait_for(serving, timeout=30)
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(
            GROUP, VERSION, "clusterlapsepolicies", f"allow-{tag}"
        )
    assert watcher.replanned >= 1


async def test_the_knative_object_reaper_function_deletes_on_a_lapse_policys_deadline(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext, tmp_path: Path
) -> None:
    """The reaper re-decides each deadline from the object as it reads it, with the policies
    in effect: the object-reaper function, as Knative serves it, follows the LapsePolicy that
    set the deadline, so it deletes (with lapse.yaml's policies alone it would find the run
    due in 24h and put it back)."""
    tag = uuid.uuid4().hex[:6]
    ns = kube.namespace(f"pol-kr-{tag}")
    finished = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    wf = await kube.workflows.create(ns, argo_workflow("wf", namespace=ns, finished_at=finished))
    uid = wf["metadata"]["uid"]
    create(kube, None, _allow(tag, ns))
    create(kube, ns, lapse_policy("short", {"kubernetes": {"ttl": "1m"}}))
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{nats_server.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"safety: {{namespaces: {{include: ['{ns}']}}}}\n"
    )
    by = f"lapsepolicy:{ns}/short@1"
    function = new_object_reaper()
    function.start({"LAPSE_CONFIG": str(config)})
    try:
        await function.started()
        assert function.ready() == (True, "ready")
        run = RunRef(
            engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
            namespace=ns, name="wf", uid=uid, phase="Succeeded", finished_at=finished,
        )  # fmt: skip
        due = CleanupDue(
            run=run, target=Target.KUBERNETES, deadline=finished + timedelta(minutes=1),
            policy=by, scheduled_at=datetime.now(UTC),
        )  # fmt: skip
        message = to_binary_event(build_event(EventType.CLEANUP_DUE, source="/test", data=due))
        transport = httpx.ASGITransport(app=ASGIApplication(function))
        async with httpx.AsyncClient(transport=transport, base_url="http://function") as http:
            answer = await http.post("/", headers=message.headers, content=message.body)
            assert answer.status_code == 202, answer.text
        outcomes = [
            parse_payload(e, CleanupCompleted)
            async for e in audit_events(
                lapse_streams, Streams().audit, event_type=EventType.CLEANUP_COMPLETED
            )
        ]
        (done,) = [o for o in outcomes if o.run.uid == uid]
        assert done.outcome is Outcome.DELETED, done
        assert done.detail is not None and by in str(done.detail), done
        assert await kube.workflows.get(ns, "wf") is None
    finally:
        function.stop()
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(
            GROUP, VERSION, "clusterlapsepolicies", f"allow-{tag}"
        )
