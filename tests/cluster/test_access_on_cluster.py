"""Who may talk to whom, on the real cluster with lapse deployed (issue 23; docs/deploy.md,
"Who may talk to whom"):

- a pod in another namespace, with tokens of its own ServiceAccount for each audience, posts
  a forged `dev.lapse.cleanup.due.v1` for a Running Workflow to every lapse function (by its
  cluster-local URL through Kourier, and straight to a running pod's container port) and to
  the Broker: each answers 401 without a token and 403 with the stranger's, and the
  Workflow is still there; the Broker's EventPolicy is Ready and applied;
- every lapse Knative Service (and the example extension, when deployed) is cluster-local;
- the NetworkPolicies select exactly lapse's pods and admit only Knative's data plane, as
  the live cluster labels them; where they are enforced (kube-router on the node,
  scripts/cluster/start.sh; `NETWORK_POLICY` of env.sh), the stranger's connections to a
  function pod's own port and to NATS are refused.

The legitimate path with all of it on is the rest of tests/cluster (test_pipeline_on_knative:
a finished Workflow deleted through the ApiServerSource, the Broker, the bridge and the
reaper, each presenting its token)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.cluster.conftest import Cluster, poll
from tests.cluster.lapse_on_cluster import (
    PLANNER,
    REAPER,
    ROW_REAPER,
    RUNS,
    SYSTEM,
    Deployment,
    rfc3339,
)

FUNCTIONS = (PLANNER, REAPER, ROW_REAPER)
BROKER_URL = f"http://broker-ingress.knative-eventing.svc.cluster.local/{SYSTEM}/lapse"
VISIBILITY = "networking.knative.dev/visibility"

# The stranger: POSTs the forged event to each target with each token, prints one JSON line
# per attempt (status, or the connection error).
INTRUDER = r"""
import json, os, socket, urllib.request, urllib.error
body = os.environ["BODY"].encode()
headers = json.loads(os.environ["CE_HEADERS"])
def say(**answer):
    print(json.dumps(answer), flush=True)
for target in json.loads(os.environ["TARGETS"]):
    if target.get("tcp"):
        host, port = target["tcp"]
        try:
            with socket.create_connection((host, port), timeout=10) as conn:
                conn.settimeout(10)
                status, text = "connected", conn.recv(200).decode(errors="replace")
        except OSError as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        say(to=target["name"], url=f"{host}:{port}", token="none", status=status, text=text)
        continue
    for token_file in (None, target["token"]):
        h = dict(headers)
        if token_file:
            h["authorization"] = "Bearer " + open(token_file).read().strip()
        request = urllib.request.Request(target["url"], data=body, method="POST", headers=h)
        try:
            with urllib.request.urlopen(request, timeout=target.get("timeout", 90)) as answer:
                status, text = answer.status, answer.read().decode()[:200]
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()[:200]
        except OSError as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        say(to=target["name"], url=target["url"], token="own" if token_file else "none",
            status=status, text=text)
"""


def running_workflow(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name},
        "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {
            "image": "busybox", "command": ["sleep", "3600"]}}]},
        "status": {"phase": "Running",
                   "startedAt": rfc3339(datetime.now(UTC) - timedelta(minutes=5))},
    }  # fmt: skip


def forged_due(name: str, uid: str) -> tuple[str, dict[str, str]]:
    """A well-formed cleanup.due (binary mode) saying the Workflow's deadline has passed."""
    now = datetime.now(UTC)
    data = {
        "run": {"engine": "argo", "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                "namespace": RUNS, "name": name, "uid": uid, "phase": "Succeeded",
                "finishedAt": rfc3339(now - timedelta(hours=2))},
        "target": "kubernetes",
        "deadline": rfc3339(now - timedelta(hours=1)),
        "policy": "forged",
        "scheduledAt": rfc3339(now - timedelta(hours=2)),
    }  # fmt: skip
    headers = {
        "content-type": "application/json",
        "ce-specversion": "1.0",
        "ce-type": "dev.lapse.cleanup.due.v1",
        "ce-source": "intruder",
        "ce-id": f"forged-{uuid.uuid4()}",
        "ce-subject": f"{RUNS}/{name}",
        "ce-target": "kubernetes",
    }
    return json.dumps(data), headers


def audience(cluster: Cluster, kind: str, name: str) -> str:
    """What lapse's Triggers name as the function's audience (or the Broker's own)."""
    if kind == "broker":
        found: str = cluster.get(SYSTEM, f"broker/{name}")["status"]["address"]["audience"]
        return found
    triggers = cluster.get(SYSTEM, "triggers")["items"]
    (value,) = {
        t["spec"]["subscriber"]["audience"]
        for t in triggers
        if t["spec"]["subscriber"].get("ref", {}).get("name") == name
    }
    return str(value)


def function_pod_ips(lapse: Deployment) -> dict[str, str]:
    ips = {}
    for service in FUNCTIONS:
        for pod in lapse.pods(service):
            if pod.get("status", {}).get("phase") == "Running" and pod["status"].get("podIP"):
                ips[service] = pod["status"]["podIP"]
    return ips


def test_a_pod_elsewhere_can_neither_call_a_function_nor_inject_into_the_broker(
    lapse: Deployment,
) -> None:
    cluster = lapse.cluster
    policy = cluster.get(SYSTEM, "eventpolicy/lapse-broker")
    cluster.wait_ready(SYSTEM, "eventpolicy/lapse-broker")
    broker = cluster.get(SYSTEM, "broker/lapse")
    applied = {p["name"] for p in broker["status"].get("policies", [])}
    assert "lapse-broker" in applied, broker["status"]
    print(f"\nEventPolicy lapse-broker admits {policy['status'].get('from')}")

    # A Running Workflow the forged event names (with its real uid).
    name = f"running-{uuid.uuid4().hex[:8]}"
    created = json.loads(
        cluster.kubectl(
            "-n", RUNS, "create", "-o", "json", "-f", "-", stdin=json.dumps(running_workflow(name))
        )
    )
    uid = created["metadata"]["uid"]
    body, headers = forged_due(name, uid)

    intruders = f"intruder-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", intruders)
    try:
        audiences = {f: audience(cluster, "function", f) for f in FUNCTIONS}
        audiences["broker"] = audience(cluster, "broker", "lapse")
        targets: list[dict[str, Any]] = [
            {"name": f, "url": f"http://{f}.{SYSTEM}.svc.cluster.local/", "token": f"/t/{f}"}
            for f in FUNCTIONS
        ]
        targets.append({"name": "broker", "url": BROKER_URL, "token": "/t/broker"})
        # Straight to the function's container, past queue-proxy (pods up now, or not).
        for service, ip in function_pod_ips(lapse).items():
            targets.append({"name": f"{service} pod", "url": f"http://{ip}:8080/",
                            "token": f"/t/{service}", "timeout": 10})  # fmt: skip
        # NATS, which holds every schedule.
        targets.append({"name": "nats", "tcp": [f"nats.{SYSTEM}.svc.cluster.local", 4222]})
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "intruder"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "intruder", "image": cluster.python_image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-u", "-c", INTRUDER],
                    "env": [{"name": "BODY", "value": body},
                            {"name": "CE_HEADERS", "value": json.dumps(headers)},
                            {"name": "TARGETS", "value": json.dumps(targets)}],
                    "volumeMounts": [{"name": "tokens", "mountPath": "/t"}],
                }],
                # Tokens of this namespace's own ServiceAccount for each audience: what any
                # pod anywhere may mint for itself.
                "volumes": [{"name": "tokens", "projected": {"sources": [
                    {"serviceAccountToken": {"audience": aud, "path": who,
                                             "expirationSeconds": 3600}}
                    for who, aud in audiences.items()
                ]}}],
            },
        }  # fmt: skip
        cluster.apply(intruders, json.dumps(pod))
        poll(
            "the intruder pod finished",
            lambda: (
                cluster.get(intruders, "pod/intruder")["status"].get("phase")
                in ("Succeeded", "Failed")
            ),
            timeout=300,
            interval=1,
        )
        log = cluster.kubectl("-n", intruders, "logs", "intruder")
        answers = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    finally:
        cluster.kubectl("delete", "namespace", intruders, "--wait=false", check=False)

    for answer in answers:
        print(f"{answer['to']:<26} token {answer['token']:<4} -> {answer['status']} "
              f"{answer['text'][:90]!r}")  # fmt: skip
    enforced = cluster.network_policy != "none"
    http = [a for a in answers if a["to"] != "nats"]
    assert len(http) == 2 * (len(targets) - 1), log
    for answer in http:
        expected = 401 if answer["token"] == "none" else 403
        if answer["to"].endswith(" pod"):
            # Past queue-proxy: NetworkPolicy lapse-functions drops the connection where a
            # plugin enforces it; elsewhere the function's own check answers (or the pod
            # scaled away in between: no connection either).
            assert answer["status"] in ({0} if enforced else {expected, 0}), answer
        else:
            assert answer["status"] == expected, answer
    assert {a["to"] for a in http} >= {*FUNCTIONS, "broker"}
    (nats,) = [a for a in answers if a["to"] == "nats"]
    if enforced:
        assert nats["status"] == 0, nats  # NetworkPolicy nats: only lapse-system's pods
    print(f"NetworkPolicy enforced by: {cluster.network_policy}")

    # Nothing was deleted: the Workflow is there, with its uid.
    still = cluster.get(RUNS, f"workflow/{name}")
    assert still["metadata"]["uid"] == uid
    assert "deletionTimestamp" not in still["metadata"]
    # The reaper saw the forgery and refused it (when it was the pod that answered).
    logs = cluster.kubectl(
        "-n", SYSTEM, "logs", "-l", f"serving.knative.dev/service={REAPER}", "-c", "function",
        "--tail=200", check=False,
    )  # fmt: skip
    print(f"object-reaper refusals logged: {logs.count('refused a request')}")
    cluster.kubectl("-n", RUNS, "delete", "workflow", name, "--wait=false", check=False)


def test_every_lapse_service_is_cluster_local(lapse: Deployment) -> None:
    cluster = lapse.cluster
    services = cluster.get(SYSTEM, "ksvc")["items"]
    names = {s["metadata"]["name"] for s in services}
    assert set(FUNCTIONS) <= names, names
    for service in services:  # the example extension too, when a test deployed it
        name = service["metadata"]["name"]
        assert service["metadata"]["labels"].get(VISIBILITY) == "cluster-local", name
        assert service["status"]["url"].endswith(".svc.cluster.local"), service["status"]["url"]
    # What Serving made of it: every rule of every lapse ingress is cluster-local only.
    ingresses = cluster.get(SYSTEM, "ingresses.networking.internal.knative.dev")["items"]
    for ingress in ingresses:
        visibilities = {r.get("visibility") for r in ingress["spec"]["rules"]}
        assert visibilities == {"ClusterLocal"}, (ingress["metadata"]["name"], visibilities)
    print(f"\ncluster-local: {sorted(names)}; {len(ingresses)} ingresses, ClusterLocal rules only")


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = (
            expression["key"],
            expression["operator"],
            expression.get("values", []),
        )
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def test_network_policies_select_lapse_pods_and_admit_only_knative(lapse: Deployment) -> None:
    cluster = lapse.cluster
    policies = {p["metadata"]["name"]: p for p in cluster.get(SYSTEM, "networkpolicy")["items"]}
    assert set(policies) >= {"lapse-functions", "lapse-dlq-sink", "lapse-bridge", "nats"}
    # Pod templates of every workload in lapse-system (the functions' revisions included,
    # whether they are scaled to zero or not).
    templates = {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in cluster.get(SYSTEM, "deployments")["items"]
    }

    def selected(policy: str) -> set[str]:
        selector = policies[policy]["spec"]["podSelector"]
        return {n for n, t in templates.items() if _matches(selector, t["metadata"]["labels"])}

    functions = selected("lapse-functions")
    owners = {templates[n]["metadata"]["labels"]["serving.knative.dev/service"] for n in functions}
    assert owners == set(FUNCTIONS), functions
    assert selected("lapse-dlq-sink") == {"lapse-dlq-sink"}
    assert selected("lapse-bridge") == {"lapse-bridge"}
    assert selected("nats") == {"nats"}
    assert not policies["lapse-bridge"]["spec"].get("ingress"), "the bridge admits nobody"

    # The functions: queue-proxy's port is admitted, the function's own port is not.
    (rule,) = policies["lapse-functions"]["spec"]["ingress"]
    ports = {p["port"] for p in rule["ports"]}
    for name in functions:
        containers = {c["name"]: c for c in templates[name]["spec"]["containers"]}
        queue = {p["containerPort"] for p in containers["queue-proxy"].get("ports", [])}
        user = {p["containerPort"] for p in containers["function"].get("ports", [])}
        assert queue & ports, (name, queue, ports)
        assert not user & ports, (name, user, ports)
    # ... from the namespaces where Knative's data plane runs, and those hold it.
    peers = {
        frm["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for frm in rule["from"]
    }
    assert peers == {"knative-serving", "kourier-system"}, peers

    def pods_in(namespace: str) -> set[str]:
        items = cluster.get(namespace, "pods")["items"]
        return {p["metadata"]["labels"].get("app", "") for p in items}

    assert "activator" in pods_in("knative-serving")
    assert "3scale-kourier-gateway" in pods_in("kourier-system")
    (dlq_rule,) = policies["lapse-dlq-sink"]["spec"]["ingress"]
    (dlq_peer,) = dlq_rule["from"]
    assert dlq_peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "knative-eventing"
    }
    eventing = [p["metadata"]["name"] for p in cluster.get("knative-eventing", "pods")["items"]]
    for component in ("mt-broker-filter", "mt-broker-ingress", "imc-dispatcher"):
        assert any(n.startswith(component) for n in eventing), (component, eventing)
    # NATS: only pods of its own namespace.
    (nats_rule,) = policies["nats"]["spec"]["ingress"]
    assert nats_rule["from"] == [{"podSelector": {}}]
    print(f"\nNetworkPolicies: lapse-functions selects {sorted(functions)}; "
          f"ports {sorted(ports)} from {sorted(peers)}")  # fmt: skip
