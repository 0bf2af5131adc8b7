"""lapse's RBAC on the real cluster with everything deployed (issue 17), asked with
SubjectAccessReviews of each ServiceAccount (its groups included, as the API server sees a
pod's token): the object-reaper may delete Workflows only in the namespaces the overlay
lists; no lapse identity may read Secrets or delete Pods anywhere; the row-reaper's running
pod has no API token where the Kubernetes client looks, only one at lapse's own path for
reviewing its senders' tokens, the one thing its identity may do.
(tests/integration/test_rbac.py asks the same of the test API server, per overlay.)"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from tests.cluster.conftest import Cluster, json_objects, poll
from tests.cluster.lapse_on_cluster import REAPER, ROW_REAPER, RUNS, SYSTEM, Deployment

IDENTITIES = {
    "lapse-apiserversource", "lapse-planner", "lapse-object-reaper", "lapse-row-reaper",
    "lapse-bridge", "lapse-dlq-sink", "lapse-streams",
    # infra/components/policies: writes the policy objects' status, re-plans their runs.
    "lapse-policy-watcher",
    # The dev NATS's Job: creates the Secret of NATS passwords, reads none.
    "lapse-nats-users",
}  # fmt: skip
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def reviews(
    cluster: Cluster, questions: list[tuple[str, str, str, str, str | None]]
) -> dict[tuple[str, str, str, str, str | None], bool]:
    """(account, verb, group, resource, namespace or None for cluster-wide) -> allowed, all
    asked in one request (a List of SubjectAccessReviews)."""
    items: list[dict[str, Any]] = []
    for account, verb, group, resource, namespace in questions:
        attributes = {"verb": verb, "group": group, "resource": resource}
        if namespace is not None:
            attributes["namespace"] = namespace
        items.append({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{SYSTEM}:{account}",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM}",
                           "system:authenticated"],
                "resourceAttributes": attributes,
            },
        })  # fmt: skip
    out = cluster.kubectl(
        "create", "-o", "json", "-f", "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )  # fmt: skip
    answers = json_objects(out)
    assert len(answers) == len(questions)
    return {q: bool(a["status"].get("allowed")) for q, a in zip(questions, answers, strict=True)}


def lapse_accounts(cluster: Cluster) -> set[str]:
    out = cluster.kubectl(
        "-n", SYSTEM, "get", "serviceaccounts", "-l", "app.kubernetes.io/part-of=lapse",
        "-o", "jsonpath={.items[*].metadata.name}",
    )  # fmt: skip
    return set(out.split())


def test_the_object_reaper_deletes_workflows_only_where_lapse_cleans(lapse: Deployment) -> None:
    cluster = lapse.cluster
    cluster.kubectl("create", "namespace", "rbac-elsewhere", check=False)
    namespaces: list[str | None] = [RUNS, "kube-system", SYSTEM, "rbac-elsewhere", None]
    questions = [
        (REAPER, verb, "argoproj.io", "workflows", ns)
        for verb in ("get", "list", "delete")
        for ns in namespaces
    ]
    try:
        answers = reviews(cluster, questions)
    finally:
        cluster.kubectl("delete", "namespace", "rbac-elsewhere", "--wait=false", check=False)
    allowed = {(verb, ns) for (_, verb, _, _, ns), ok in answers.items() if ok}
    # list: a policy's keep_last is counted again from a fresh list before a deletion.
    assert allowed == {("get", RUNS), ("list", RUNS), ("delete", RUNS)}, allowed
    # And nothing it does not need where it may delete.
    more = reviews(cluster, [
        (REAPER, verb, "argoproj.io", "workflows", RUNS) for verb in ("update", "patch", "watch")
    ])  # fmt: skip
    assert not any(more.values()), more


def test_no_lapse_identity_reads_secrets_or_deletes_pods(lapse: Deployment) -> None:
    cluster = lapse.cluster
    accounts = lapse_accounts(cluster)
    assert accounts == IDENTITIES, accounts  # a new identity must be added here, on purpose
    namespaces: list[str | None] = [RUNS, SYSTEM, "kube-system", None]
    questions = [
        (account, verb, "", resource, ns)
        for account in sorted(accounts)
        for verb, resource in (("get", "secrets"), ("list", "secrets"), ("watch", "secrets"),
                               ("delete", "pods"), ("deletecollection", "pods"))
        for ns in namespaces
    ]  # fmt: skip
    answers = reviews(cluster, questions)
    granted = [q for q, ok in answers.items() if ok]
    assert not granted, granted
    # The question is answerable: the cluster's admin may (so "no" above is RBAC's answer).
    sanity = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", SYSTEM).strip()
    assert sanity == "yes"


def wake(cluster: Cluster, service: str) -> None:
    """One request through Kourier's internal gateway, so Serving starts a pod (any answer
    will do: the pod exists then)."""
    host = cluster.get(SYSTEM, f"ksvc/{service}")["status"]["url"].split("://", 1)[1]
    gateway = cluster.get("kourier-system", "service/kourier-internal")["spec"]["clusterIP"]
    request = urllib.request.Request(f"http://{gateway}/health/readiness", headers={"Host": host})
    with urllib.request.urlopen(request, timeout=90) as answer:
        answer.read()


def test_the_row_reaper_pod_mounts_only_a_token_review_token(lapse: Deployment) -> None:
    cluster = lapse.cluster
    if not lapse.pods(ROW_REAPER):
        wake(cluster, ROW_REAPER)
    pod = poll(
        f"a running {ROW_REAPER} pod",
        lambda: next(
            (p for p in lapse.pods(ROW_REAPER) if p.get("status", {}).get("phase") == "Running"),
            None,
        ),
        timeout=120,
    )
    spec = pod["spec"]
    assert spec["serviceAccountName"] == ROW_REAPER
    # Knative leaves the pod's own field unset: the ServiceAccount's decides.
    assert spec.get("automountServiceAccountToken") in (None, False), spec
    account = cluster.get(SYSTEM, f"serviceaccount/{ROW_REAPER}")
    assert account.get("automountServiceAccountToken") is False, account
    # One projected token, at lapse's own path, for the TokenReviews of its senders
    # (lapse/runtime/senders.py): none where the Kubernetes client looks for one.
    projected_tokens = [
        v["name"]
        for v in spec.get("volumes", [])
        for source in v.get("projected", {}).get("sources", [])
        if "serviceAccountToken" in source
    ]
    assert projected_tokens == ["review-token"], projected_tokens
    mounts = [
        (c["name"], m["mountPath"])
        for c in spec["containers"] + spec.get("initContainers", [])
        for m in c.get("volumeMounts", [])
    ]
    assert not [m for m in mounts if m[1].startswith(TOKEN_PATH)], mounts
    # ... and the only thing its identity may do with it: review tokens.
    answers = reviews(cluster, [
        (ROW_REAPER, "create", "authentication.k8s.io", "tokenreviews", None),
        *[(ROW_REAPER, verb, group, resource, ns)
          for verb in ("get", "list", "create", "delete")
          for group, resource in (("", "pods"), ("", "configmaps"), ("", "serviceaccounts/token"),
                                  ("argoproj.io", "workflows"),
                                  ("authorization.k8s.io", "subjectaccessreviews"))
          for ns in (RUNS, SYSTEM, None)],
    ])  # fmt: skip
    granted = sorted((*q[1:4], str(q[4])) for q, ok in answers.items() if ok)
    assert granted == [("create", "authentication.k8s.io", "tokenreviews", "None")], granted
    # The object-reaper, which does talk to the API server, has one: the check can fail.
    if not lapse.pods(REAPER):
        wake(cluster, REAPER)
    reaper = poll(f"a {REAPER} pod", lambda: lapse.pods(REAPER), timeout=120)[0]
    reaper_mounts = [
        m["mountPath"] for c in reaper["spec"]["containers"] for m in c.get("volumeMounts", [])
    ]
    assert TOKEN_PATH in reaper_mounts, reaper_mounts
    print(f"\n{pod['metadata']['name']}: volumes {[v['name'] for v in spec['volumes']]}, "
          f"mounts {mounts}")  # fmt: skip
