"""Least privilege, proven by the real kube-apiserver: the RBAC objects the overlays render
are applied (for real) and every component's ServiceAccount is asked about with
SubjectAccessReviews. Delete rights exist only in the namespaces an overlay lists."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import KubeStack
from tests.infra_package import kubectl, rendered, rendered_with_components

pytestmark = [pytest.mark.kube]

RBAC_KINDS = {
    "Namespace",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ClusterRole",
    "ClusterRoleBinding",
}
# group, resource of every kind lapse deletes.
RUN_KINDS = [
    ("argoproj.io", "workflows"),
    ("tekton.dev", "pipelineruns"),
    ("tekton.dev", "taskruns"),
    ("batch", "jobs"),
    ("trainer.kubeflow.org", "trainjobs"),
    ("ray.io", "rayjobs"),
    ("jobset.x-k8s.io", "jobsets"),
    ("sparkoperator.k8s.io", "sparkapplications"),
]


def apply_rbac(kube: KubeStack, overlay: str) -> None:
    apply_rbac_of(kube, rendered(overlay))


def apply_rbac_of(kube: KubeStack, rendered_docs: list[dict[str, Any]]) -> None:
    docs = [d for d in rendered_docs if d["kind"] in RBAC_KINDS]
    for namespace in {d["metadata"].get("namespace") for d in docs} - {None}:
        kube.namespace(namespace)
    out = subprocess.run(
        [
            str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side",
            "--field-manager=lapse-test", "-f", "-",
        ],
        input=yaml.safe_dump_all(docs), capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def may(
    kube: KubeStack,
    account: str,
    verb: str,
    resource: tuple[str, str],
    namespace: str | None,
    *,
    account_namespace: str = "lapse-system",
) -> bool:
    """Whether the ServiceAccount may; `resource` is (group, plural[/subresource])."""
    group, plural = resource
    plural, _, subresource = plural.partition("/")
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{account_namespace}:{account}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{account_namespace}"],
            resource_attributes=client.V1ResourceAttributes(
                group=group,
                resource=plural,
                subresource=subresource or None,
                verb=verb,
                namespace=namespace,
            ),
        )
    )
    answer = client.AuthorizationV1Api(kube.api_client).create_subject_access_review(review)
    return bool(answer.status.allowed)


EVENTS = ("", "events")


def test_the_object_reaper_deletes_only_in_the_namespaces_listed(kube: KubeStack) -> None:
    apply_rbac(kube, "production")  # cleans team-a and team-b
    reaper = "lapse-object-reaper"
    for kind in RUN_KINDS:
        for namespace in ("team-a", "team-b"):
            assert may(kube, reaper, "get", kind, namespace), (kind, namespace)
            assert may(kube, reaper, "delete", kind, namespace), (kind, namespace)
            # A keep_last group is counted again before a run of it is deleted.
            assert may(kube, reaper, "list", kind, namespace), (kind, namespace)
        for namespace in ("kube-system", "lapse-system", "default", None):
            assert not may(kube, reaper, "delete", kind, namespace), (kind, namespace)
        assert not may(kube, reaper, "update", kind, "team-a"), kind
        assert not may(kube, reaper, "watch", kind, "team-a"), kind
    # Listed only where it deletes: never cluster-wide, never another namespace.
    assert may(kube, reaper, "list", ("tekton.dev", "taskruns"), "team-a")
    assert not may(kube, reaper, "list", ("argoproj.io", "workflows"), None)
    assert not may(kube, reaper, "list", ("argoproj.io", "workflows"), "kube-system")
    assert may(kube, reaper, "create", EVENTS, "team-a")
    assert not may(kube, reaper, "create", EVENTS, "kube-system")
    assert not may(kube, reaper, "delete", ("", "pods"), "team-a")
    assert not may(kube, reaper, "get", ("", "secrets"), "team-a")


def test_the_planner_and_the_source_read_and_never_delete(kube: KubeStack) -> None:
    apply_rbac(kube, "production")
    for account in ("lapse-planner", "lapse-apiserversource"):
        for kind in RUN_KINDS:
            for verb in ("get", "list", "watch"):
                assert may(kube, account, verb, kind, "team-a"), (account, verb, kind)
                assert not may(kube, account, verb, kind, "kube-system"), (account, verb, kind)
            # No cluster-wide list: the source watches namespace by namespace.
            assert not may(kube, account, "list", kind, None), (account, kind)
            for namespace in ("team-a", "kube-system", None):
                for verb in ("delete", "deletecollection", "update", "patch", "create"):
                    assert not may(kube, account, verb, kind, namespace), (account, verb, kind)
    assert not may(kube, "lapse-planner", "create", EVENTS, "team-a")


def test_the_other_components_may_do_nothing(kube: KubeStack) -> None:
    apply_rbac(kube, "dev")
    for account in ("lapse-row-reaper", "lapse-bridge", "lapse-dlq-sink", "lapse-streams"):
        for kind in [*RUN_KINDS, EVENTS, ("", "secrets"), ("", "configmaps")]:
            for namespace in ("default", "lapse-system", None):
                for verb in ("get", "list", "delete", "create"):
                    assert not may(kube, account, verb, kind, namespace), (account, verb, kind)


@pytest.mark.parametrize("overlay", ["dev", "single-process"])
def test_the_nats_users_job_may_create_a_secret_and_read_none(
    kube: KubeStack, overlay: str
) -> None:
    apply_rbac(kube, overlay)
    secrets = ("", "secrets")
    assert may(kube, "lapse-nats-users", "create", secrets, "lapse-system")
    for namespace in ("lapse-system", "default", "kube-system", None):
        for verb in ("get", "list", "watch", "update", "patch", "delete"):
            assert not may(kube, "lapse-nats-users", verb, secrets, namespace), (verb, namespace)
    assert not may(kube, "lapse-nats-users", "create", secrets, "default")


def test_lapse_up_watches_everywhere_and_deletes_only_where_listed(kube: KubeStack) -> None:
    apply_rbac(kube, "single-process")  # cleans default
    workflows = ("argoproj.io", "workflows")
    assert may(kube, "lapse", "watch", workflows, None)  # its one cluster-wide watch
    # Its artifact-reaper lists Workflows cluster-wide before deleting (what live runs record).
    assert may(kube, "lapse", "list", workflows, None)
    assert may(kube, "lapse", "list", ("batch", "jobs"), None)
    assert may(kube, "lapse", "delete", workflows, "default")
    for namespace in ("kube-system", "lapse-system", None):
        assert not may(kube, "lapse", "delete", workflows, namespace), namespace
    assert not may(kube, "lapse", "create", EVENTS, "kube-system")


POLICIES = ("lapse.dev", "lapsepolicies")
CLUSTER_POLICIES = ("lapse.dev", "clusterlapsepolicies")


def test_on_knative_the_policy_watcher_writes_only_status_and_the_functions_only_read(
    kube: KubeStack,
) -> None:
    """infra/components/policies: the watcher reads every policy object and writes only
    their status, and reads runs only where the planner does (to re-plan them); the
    ttl-planner and the object-reaper read the policy objects and write nothing of them."""
    apply_rbac(kube, "production")
    watcher = "lapse-policy-watcher"
    for resource in (POLICIES, CLUSTER_POLICIES):
        for verb in ("get", "list", "watch"):
            assert may(kube, watcher, verb, resource, None), (verb, resource)
        for verb in ("create", "update", "patch", "delete"):
            assert not may(kube, watcher, verb, resource, None), (verb, resource)
    assert may(kube, watcher, "patch", ("lapse.dev", "lapsepolicies/status"), "team-a")
    assert may(kube, watcher, "patch", ("lapse.dev", "clusterlapsepolicies/status"), None)
    assert may(kube, watcher, "list", ("", "namespaces"), None)
    for kind in RUN_KINDS:
        assert may(kube, watcher, "list", kind, "team-a"), kind
        assert not may(kube, watcher, "list", kind, "kube-system"), kind
        assert not may(kube, watcher, "list", kind, None), kind
        for verb in ("delete", "update", "patch", "create"):
            assert not may(kube, watcher, verb, kind, "team-a"), (verb, kind)
    for follower in ("lapse-planner", "lapse-object-reaper"):
        for resource in (POLICIES, CLUSTER_POLICIES):
            for verb in ("get", "list", "watch"):
                assert may(kube, follower, verb, resource, None), (follower, verb, resource)
            for verb in ("create", "update", "patch", "delete"):
                assert not may(kube, follower, verb, resource, None), (follower, verb, resource)
        status = ("lapse.dev", "lapsepolicies/status")
        assert not may(kube, follower, "patch", status, "team-a"), follower
    # Nobody else of the Knative path reads them.
    for other in ("lapse-row-reaper", "lapse-bridge", "lapse-dlq-sink", "lapse-streams"):
        assert not may(kube, other, "list", POLICIES, None), other


WORKFLOWS = ("argoproj.io", "workflows")


def test_the_artifact_reaper_lists_workflows_everywhere_and_does_nothing_else(
    kube: KubeStack, tmp_path: Path
) -> None:
    """infra/components/artifacts: before a pass deletes anything the artifact-reaper lists
    the Argo Workflows of every namespace, in pages (lapse/edges/artifacts/live.py), so the
    keys a run still in the API server records are kept. That list is its one right on
    runs: it reads no single run, watches nothing, writes nothing, reads no Secret."""
    docs = rendered_with_components("dev", ["artifacts"], tmp_path)
    (account,) = [
        d
        for d in docs
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "lapse-artifact-reaper"
    ]
    # The list needs an API token in its pods (the in-cluster client reads the mounted one).
    assert account.get("automountServiceAccountToken", True) is True
    apply_rbac_of(kube, docs)
    reaper = "lapse-artifact-reaper"
    for namespace in (None, "default", "kube-system", "lapse-system", "team-x"):
        assert may(kube, reaper, "list", WORKFLOWS, namespace), namespace
        for verb in ("get", "watch", "create", "update", "patch", "delete", "deletecollection"):
            assert not may(kube, reaper, verb, WORKFLOWS, namespace), (verb, namespace)
        for kind in RUN_KINDS[1:]:  # only Argo's kinds record artifact keys
            assert not may(kube, reaper, "list", kind, namespace), (kind, namespace)
        for kind in (("", "secrets"), ("", "configmaps"), ("", "pods")):
            for verb in ("get", "list", "watch"):
                assert not may(kube, reaper, verb, kind, namespace), (verb, kind, namespace)
        assert not may(kube, reaper, "create", EVENTS, namespace), namespace
    assert not may(kube, reaper, "list", POLICIES, None)
    assert may(kube, reaper, "create", ("authentication.k8s.io", "tokenreviews"), None)
