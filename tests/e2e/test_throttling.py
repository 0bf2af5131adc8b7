"""The API server throttling lapse with 429: a real kube-apiserver whose priority and
fairness gives lapse's user one seat and rejects the rest (a FlowSchema and a
PriorityLevelConfiguration, as a cluster admin would set them), while deletions come due.
Every deletion completes, none is dead-lettered, and lapse waits at least the Retry-After
the server asked for before it tries an object again, all read from the API server's own
audit log.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client

from lapse.embedded.kube import READONLY_USER
from lapse.embedded.nats import EmbeddedNats
from tests.conftest import KubeStack
from tests.e2e.apiserver_audit import audited_kube_stack, check_one_delete_each, requests
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

COUNT = 40
LAPSE_USER = READONLY_USER  # a plain user: system:masters is exempt from priority and fairness
LEVEL = "lapse-throttled"


@pytest.fixture
def throttled_kube(tmp_path: Path) -> Iterator[tuple[KubeStack, Path]]:
    # Few seats in all, so that the one share lapse's level gets is a single seat.
    limits = ("--max-requests-inflight", "20", "--max-mutating-requests-inflight", "10")
    with audited_kube_stack(tmp_path / "kube", *limits, verbs=("get", "delete")) as stack:
        yield stack


def throttle_lapse(kube: KubeStack) -> None:
    """lapse's user may read and delete Workflows, through one seat, with no queue."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    rule = client.V1PolicyRule(
        api_groups=["argoproj.io"],
        resources=["workflows"],
        verbs=["get", "list", "watch", "delete"],
    )
    rbac.create_cluster_role(
        client.V1ClusterRole(metadata=client.V1ObjectMeta(name="lapse"), rules=[rule])
    )
    subject = client.RbacV1Subject(
        kind="User", name=LAPSE_USER, api_group="rbac.authorization.k8s.io"
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name="lapse"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="lapse"
            ),
            subjects=[subject],
        )
    )
    flow = client.FlowcontrolApiserverV1Api(kube.api_client)
    flow.create_priority_level_configuration(
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": LEVEL},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 1,
                    "lendablePercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        }
    )
    flow.create_flow_schema(
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": LEVEL},
            "spec": {
                "priorityLevelConfiguration": {"name": LEVEL},
                "matchingPrecedence": 100,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [{"kind": "User", "user": {"name": LAPSE_USER}}],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                    }
                ],
            },
        }
    )


def retry_after_of_a_rejection(kube: KubeStack, namespace: str) -> float:
    """Many reads at once as lapse's user: the server rejects some with 429; their
    Retry-After. Also proves the throttle is in place before lapse starts."""
    server = kube.server
    url = f"{server.url}/apis/argoproj.io/v1alpha1/namespaces/{namespace}/workflows"
    ca = ssl.create_default_context(cafile=server.work_dir / "certs" / "apiserver.crt")
    headers = {"Authorization": f"Bearer {server.readonly_token}"}

    def read(_: int) -> httpx.Response:
        with httpx.Client(verify=ca, headers=headers, timeout=30) as http:
            return http.get(url)

    for _ in range(20):  # flow control takes a moment to see the new FlowSchema
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(read, range(64)))
        rejected = [a for a in answers if a.status_code == 429]
        if rejected:
            return float(rejected[0].headers["Retry-After"])
    raise AssertionError("the API server never rejected lapse's user with 429")


async def test_throttled_with_429_every_deletion_completes_after_retry_after(
    tmp_path: Path, own_nats: EmbeddedNats, throttled_kube: tuple[KubeStack, Path]
) -> None:
    kube, audit_log = throttled_kube
    throttle_lapse(kube)
    ns = kube.namespace(f"throttled-{uuid.uuid4().hex[:6]}")
    retry_after = await asyncio.to_thread(retry_after_of_a_rejection, kube, ns)
    kubeconfig = tmp_path / "lapse.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(kube.server.kubeconfig(kube.server.readonly_token, user=LAPSE_USER))
    )
    config = tmp_path / "lapse.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "nats": {"url": own_nats.url},
                "kubernetes": {"kubeconfig": str(kubeconfig)},
                "safety": {"max_deletions_per_second": 500, "namespaces": {"include": ["*"]}},
            }
        )
    )
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    names = [f"wf-{i}" for i in range(COUNT)]
    try:
        for name in names:  # all due together, 3 s from now
            body = finished_workflow(name, annotations={"lapse.dev/ttl": "3s"})
            await kube.workflows.create(ns, body)

        async def all_gone() -> bool:
            return not (await kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=180, interval=0.5)
        await asyncio.sleep(1)  # the last DELETE's audit line follows its commit
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        status = lapse_json("status", config=config)
    finally:
        assert up.stop() == 0, up.log.read_text()[-3000:]

    by_object = requests(audit_log, ns, "get", "delete")
    lapse_requests = {
        name: [r for r in rs if r.user == LAPSE_USER] for name, rs in by_object.items()
    }
    rejected = [r for rs in lapse_requests.values() for r in rs if r.code == 429]
    assert len(rejected) >= 5, "lapse must really have been throttled"
    # Retry-After honoured: after a 429, the next request for that object came no sooner.
    gaps = []
    for rs in lapse_requests.values():
        for answered, following in itertools.pairwise(rs):
            if answered.code == 429:
                gaps.append(following.at - answered.done)
    assert gaps and min(gaps) >= retry_after - 0.05, sorted(gaps)[:5]
    # Every deletion completed, once, and nothing was given up.
    check_one_delete_each(
        {n: [r for r in rs if r.verb == "delete"] for n, rs in lapse_requests.items()}, names
    )
    outcomes = Counter((row["name"], row["outcome"]) for row in history)
    assert set(outcomes) == {(name, "deleted") for name in names}, outcomes
    assert set(outcomes.values()) == {1}
    assert status["deadLetters"] == 0
    late = sorted(row["latencySeconds"] for row in history)
    print(
        f"\n429 throttling: {COUNT} due at once, {len(rejected)} requests rejected with 429 "
        f"(Retry-After {retry_after:.0f}s), retried no sooner than {min(gaps):.2f}s after; "
        f"all deleted once, DLQ 0, lateness p50 {late[len(late) // 2]:.1f}s max {late[-1]:.1f}s"
    )
