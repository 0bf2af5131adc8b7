"""The deploy package (infra/) on the real cluster, beyond "lapse works" (the other tests):

- lapse-system enforces Pod Security `restricted` (the label ships in
  infra/base/namespace.yaml) and every lapse pod is admitted there, Ready, running as
  65532 (infra/components/lapse-pods);
- an upgrade is one `kubectl apply -k`, even when the streams pod's template changes (it
  was a Job, immutable, which had to be deleted by hand first);
- the Prometheus Operator's CRDs accept infra/components/monitoring (PodMonitors,
  PrometheusRule, the Grafana dashboard's ConfigMap), and a lapse process serves /metrics
  on the port they scrape;
- an ApiServerSource that lists a kind whose CRD the cluster lacks is never Ready and sends
  nothing, not even the kinds the cluster has; without that kind it delivers (hence one
  Component per engine, infra/components/kinds).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_on_cluster import (
    SYSTEM,
    Deployment,
    finished_workflow,
    kubectl_apply_retrying,
    kubectl_waiting,
    overlay_for,
)
from tests.cluster.test_cluster_smoke import received, subscriber_manifest
from tests.infra_package import INFRA, prometheus_operator_crds

UID = "65532"
# Every Deployment the dev overlay runs in lapse-system.
DEPLOYMENTS = {"nats", "lapse-bridge", "lapse-dlq-sink", "lapse-streams", "lapse-policy-watcher"}
FUNCTIONS = {"lapse-ttl-planner", "lapse-object-reaper", "lapse-row-reaper"}


def kubectl_result(
    cluster: Cluster, *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, *args],
        input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def items(cluster: Cluster, namespace: str, what: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.get(namespace, what)["items"]
    return found


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_lapse_system_enforces_the_restricted_profile(cluster: Cluster, lapse: Deployment) -> None:
    labels = json.loads(cluster.kubectl("get", "namespace", SYSTEM, "-o", "json"))["metadata"][
        "labels"
    ]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    # Enforced, not decoration: a pod without the securityContext is refused there.
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"unrestricted-{uuid.uuid4().hex[:6]}", "namespace": SYSTEM},
        "spec": {"containers": [{"name": "c", "image": cluster.python_image}]},
    }  # fmt: skip
    out = kubectl_result(cluster, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod))
    assert out.returncode != 0
    assert 'violates PodSecurity "restricted' in out.stderr, out.stderr


def test_every_lapse_pod_is_admitted_ready_and_runs_as_lapses_user(
    cluster: Cluster, lapse: Deployment
) -> None:
    deployments = {
        d["metadata"]["name"]: d
        for d in items(cluster, SYSTEM, "deployments")
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "lapse"
        # (not the Deployments Knative makes for the functions' revisions: below)
        and "serving.knative.dev/service" not in d["metadata"]["labels"]
    }
    assert set(deployments) == DEPLOYMENTS
    for name, deployment in deployments.items():
        assert deployment["status"].get("readyReplicas") == deployment["spec"]["replicas"], name
    # The functions: each latest Revision became Ready (Knative started a pod and its
    # readiness probe passed, then may have scaled it to zero).
    for service in FUNCTIONS:
        ksvc = cluster.get(SYSTEM, f"ksvc/{service}")
        revision = cluster.get(SYSTEM, f"revision/{ksvc['status']['latestReadyRevisionName']}")
        conditions = {c["type"]: c["status"] for c in revision["status"]["conditions"]}
        assert conditions["Ready"] == "True", (service, revision["status"])

    pods = [p for p in items(cluster, SYSTEM, "pods") if p["status"].get("phase") == "Running"]
    lapse_pods = [
        p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/part-of") == "lapse"
    ]
    assert {
        p["metadata"]["labels"].get("app.kubernetes.io/name") for p in lapse_pods
    } >= DEPLOYMENTS
    for pod in lapse_pods:
        name = pod["metadata"]["name"]
        assert ready(pod), name
        for container in pod["spec"]["containers"]:
            if container["name"] == "queue-proxy":  # Knative's own, restricted by Knative
                continue
            uid = cluster.kubectl("-n", SYSTEM, "exec", name, "-c", container["name"], "--",
                                  "id", "-u")  # fmt: skip
            assert uid.strip() == UID, (name, container["name"])
    # Knative's ApiServerSource adapter runs in lapse-system too, admitted as well.
    adapters = [p for p in pods if "apiserversource" in p["metadata"]["name"]]
    assert adapters and all(ready(p) for p in adapters), [p["metadata"]["name"] for p in pods]
    # No controller was refused a pod here (a ReplicaSet, Job or Revision whose pods break
    # the profile leaves a FailedCreate event saying so).
    refused = [
        e["message"] for e in items(cluster, SYSTEM, "events") if "PodSecurity" in e["message"]
    ]
    assert refused == []
    print(f"\n{len(lapse_pods)} lapse pods Ready under Pod Security restricted, all as UID {UID}")


def test_an_upgrade_that_changes_the_streams_pod_is_one_apply(
    cluster: Cluster, lapse: Deployment, tmp_path: Path
) -> None:
    """What used to need `kubectl delete job lapse-streams` first: the streams pod's
    template changes (here an annotation; in an upgrade, the image) and the overlay is
    applied again, as is."""
    (before,) = [
        p["metadata"]["uid"]
        for p in items(cluster, SYSTEM, "pods")
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "lapse-streams"
        and "deletionTimestamp" not in p["metadata"]
    ]
    # The dev NATS's password Job removes itself once finished (ttlSecondsAfterFinished: 0),
    # as it has long before any real upgrade.
    poll(
        "the Job lapse-nats-users removed after it finished",
        lambda: (
            not cluster.kubectl(
                "-n", SYSTEM, "get", "job", "lapse-nats-users", "--ignore-not-found", "-o", "name"
            ).strip()
        ),
        timeout=120,
    )
    overlay = overlay_for(tmp_path, lapse.images)
    kustomization = json.loads((overlay / "kustomization.yaml").read_text())
    changed = [
        {
            "op": "add",
            "path": "/spec/template/metadata/annotations",
            "value": {"lapse.dev/upgrade-test": uuid.uuid4().hex},
        }
    ]
    for target in ({"kind": "Deployment", "name": "lapse-streams"},
                   {"kind": "Job", "name": "lapse-nats-users"}):  # fmt: skip
        kustomization["patches"].append({"target": target, "patch": json.dumps(changed)})
    (overlay / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2))

    kubectl_apply_retrying(cluster, "-k", str(overlay))  # no delete before it
    kubectl_waiting(cluster, "-n", SYSTEM, "rollout", "status", "deploy/lapse-streams",
                    timeout=180)  # fmt: skip
    (after,) = [
        p
        for p in items(cluster, SYSTEM, "pods")
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "lapse-streams"
        and "deletionTimestamp" not in p["metadata"]
    ]
    assert after["metadata"]["uid"] != before
    assert ready(after)  # Ready = `lapse infra apply` succeeded again
    logs = cluster.kubectl("-n", SYSTEM, "logs", after["metadata"]["name"])
    print(f"\nthe streams applied again by the upgraded pod:\n{logs.strip()[-600:]}")


def test_the_prometheus_operator_accepts_the_monitoring_component(
    cluster: Cluster, lapse: Deployment, tmp_path: Path
) -> None:
    crds = prometheus_operator_crds()
    cluster.kubectl(
        "apply", "--server-side", "-f", "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds}),
    )  # fmt: skip
    for crd in crds:
        cluster.kubectl("wait", f"crd/{crd['metadata']['name']}", "--for=condition=Established",
                        "--timeout=60s")  # fmt: skip
    # The component on its own (what an overlay adds to lapse-system by including it).
    component = os.path.relpath(INFRA / "components" / "monitoring", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                        "components": [component]})
    )  # fmt: skip
    rendered = cluster.kubectl("kustomize", str(tmp_path))
    out = kubectl_result(cluster, "apply", "--server-side", "--validate=strict", "-f", "-",
                         stdin=rendered)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for what in ("podmonitor/lapse", "podmonitor/lapse-functions", "prometheusrule/lapse",
                 "networkpolicy/lapse-metrics"):  # fmt: skip
        assert cluster.get(SYSTEM, what)["metadata"]["name"] == what.split("/")[1]
    rule = cluster.get(SYSTEM, "prometheusrule/lapse")
    assert len(rule["spec"]["groups"][0]["rules"]) == 5
    dashboard = cluster.get(SYSTEM, "configmap/lapse-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["lapse.json"])["panels"]

    # The CRD's schema bites: a PodMonitor with a port number out of range is refused.
    (podmonitor,) = [
        d for d in yaml.safe_load_all(rendered) if d and d["metadata"]["name"] == "lapse"
        and d["kind"] == "PodMonitor"
    ]  # fmt: skip
    podmonitor["metadata"]["name"] = "lapse-broken"
    podmonitor["spec"]["podMetricsEndpoints"] = [{"portNumber": 0}]
    out = kubectl_result(cluster, "create", "--dry-run=server", "-f", "-",
                         stdin=json.dumps(podmonitor))  # fmt: skip
    assert out.returncode != 0 and "portNumber" in out.stderr, out.stderr

    # What they scrape: the bridge serves /metrics on its port `metrics` (9464).
    bridge = next(
        p["metadata"]["name"]
        for p in items(cluster, SYSTEM, "pods")
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "lapse-bridge" and ready(p)
    )
    scrape = (
        "import urllib.request as u; r = u.urlopen('http://127.0.0.1:9464/metrics', timeout=5);"
        " print(r.status, r.headers['content-type']); print(r.read().decode()[:400])"
    )
    answer = cluster.kubectl("-n", SYSTEM, "exec", bridge, "--", "python", "-c", scrape)
    assert answer.startswith("200 text/plain"), answer
    print(f"\nthe bridge's /metrics:\n{answer}")


def test_an_apiserversource_listing_an_absent_kind_sends_nothing_until_it_is_dropped(
    cluster: Cluster, namespace: str
) -> None:
    """Why each engine's kinds are a Component (infra/components/kinds): Knative's adapter
    stops at start on a kind the API server does not serve, so the source is never Ready
    and sends no event, not even those of the kinds the cluster has, and those are lost.
    Without that kind it is Ready and delivers."""
    cluster.apply(namespace, subscriber_manifest(cluster.python_image))
    cluster.kubectl("-n", namespace, "rollout", "status", "deploy/subscriber", "--timeout=120s")
    workflows = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow"}
    absent = {"apiVersion": "absent.lapse.dev/v1", "kind": "Nothing"}
    source: dict[str, Any] = {
        "apiVersion": "sources.knative.dev/v1", "kind": "ApiServerSource",
        "metadata": {"name": "runs"},
        "spec": {"mode": "Resource", "serviceAccountName": "source",
                 "resources": [workflows, absent],
                 "sink": {"ref": {"apiVersion": "v1", "kind": "Service", "name": "subscriber"}}},
    }  # fmt: skip
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "source"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "source"},
         "rules": [{"apiGroups": ["argoproj.io", "absent.lapse.dev"],
                    "resources": ["workflows", "nothings"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "source"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "source"},
         "subjects": [{"kind": "ServiceAccount", "name": "source", "namespace": namespace}]},
    ]  # fmt: skip
    assert "nothings.absent.lapse.dev" not in cluster.kubectl("get", "crd", "-o", "name")
    cluster.apply(namespace, json.dumps({"apiVersion": "v1", "kind": "List",
                                         "items": [*rbac, source]}))  # fmt: skip
    selector = "eventing.knative.dev/source=apiserver-source-controller"

    def adapter_failed() -> str:
        # The running attempt's log, and the one before it (in back-off there may be none
        # running).
        logs = "".join(
            cluster.kubectl(
                "-n", namespace, "logs", "-l", selector, "--tail=50", *previous, check=False
            )
            for previous in ((), ("--previous",))
        )
        return next((line for line in logs.splitlines() if "absent.lapse.dev" in line
                     and "failed" in line), "")  # fmt: skip

    said = poll("the adapter stopping on the absent kind", adapter_failed, timeout=180)
    ip = cluster.get(namespace, "service/subscriber")["spec"]["clusterIP"]
    first = f"unsent-{uuid.uuid4().hex[:6]}"
    cluster.apply(namespace, json.dumps(finished_workflow(first, datetime.now(UTC), "1h")))
    conditions = {c["type"]: c for c in cluster.get(namespace, "apiserversource/runs")["status"]
                  ["conditions"]}  # fmt: skip
    assert conditions["Ready"]["status"] != "True", conditions["Ready"]

    # Without the absent kind (what leaving out an engine's Component does): Ready, and the
    # Workflow events flow.
    source["spec"]["resources"] = [workflows]
    cluster.apply(namespace, json.dumps(source))
    cluster.wait_ready(namespace, "apiserversource/runs", timeout=180)
    second = f"sent-{uuid.uuid4().hex[:6]}"
    cluster.apply(namespace, json.dumps(finished_workflow(second, datetime.now(UTC), "1h")))
    poll(
        f"an event of Workflow {second}",
        lambda: [e for e in received(ip) if second in e.get("data", "")],
        timeout=120,
    )
    # The one written while the adapter was failing is never sent: a starting adapter sends
    # nothing for what already exists (its initial list is dropped), so it was lost, not
    # late (it came before the one that arrived). `lapse reconcile` finds such runs.
    assert not [e for e in received(ip) if first in e.get("data", "")]
    print(f"\nwith an absent kind the adapter said: {said[:300]}\nwithout it: Ready, delivered")
