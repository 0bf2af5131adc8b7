"""Smoke test of the single-node cluster `make cluster` starts (docs/cluster.md): a pod runs,
a Broker + Trigger delivers a CloudEvent to a subscriber Service, and an ApiServerSource
delivers an object's add event through the Broker. Run by `make test-cluster`."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import pytest

from tests.cluster.conftest import Cluster, poll

# A subscriber: keeps every CloudEvent POSTed to it (binary or structured mode) and lists
# them on GET /events. Runs on the Debian python image build-images.sh makes, pulled from
# the local registry.
SUBSCRIBER = r"""
import json, http.server
seen = []
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        ce = {k[3:].lower(): v for k, v in self.headers.items() if k.lower().startswith("ce-")}
        if self.headers.get("content-type", "").startswith("application/cloudevents+json"):
            ce = json.loads(body); body = json.dumps(ce.pop("data", None)).encode()
        ce["data"] = body.decode("utf-8", "replace")
        seen.append(ce); print("event", ce.get("type"), ce.get("id"), flush=True)
        self.send_response(202); self.end_headers()
    def do_GET(self):
        out = json.dumps(seen).encode()
        self.send_response(200); self.send_header("content-length", str(len(out)))
        self.end_headers(); self.wfile.write(out)
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("", 8080), H).serve_forever()
"""


def subscriber_manifest(image: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": "subscriber"},
                    "spec": {
                        "selector": {"matchLabels": {"app": "subscriber"}},
                        "template": {
                            "metadata": {"labels": {"app": "subscriber"}},
                            "spec": {
                                "containers": [
                                    {
                                        "name": "subscriber",
                                        "image": image,
                                        "imagePullPolicy": "IfNotPresent",
                                        "command": ["python3", "-u", "-c", SUBSCRIBER],
                                        "ports": [{"containerPort": 8080}],
                                        "readinessProbe": {
                                            "httpGet": {"path": "/events", "port": 8080},
                                            "periodSeconds": 1,
                                        },
                                    }
                                ]
                            },
                        },
                    },
                },
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "subscriber"},
                    "spec": {
                        "selector": {"app": "subscriber"},
                        "ports": [{"port": 80, "targetPort": 8080}],
                    },
                },
            ],
        }
    )


def broker_and_subscriber(cluster: Cluster, ns: str) -> str:
    """A Broker `default` and the subscriber in `ns`; returns the subscriber's ClusterIP."""
    cluster.apply(
        ns,
        json.dumps(
            {
                "apiVersion": "eventing.knative.dev/v1",
                "kind": "Broker",
                "metadata": {"name": "default"},
            }
        ),
    )
    cluster.apply(ns, subscriber_manifest(cluster.python_image))
    cluster.kubectl("-n", ns, "rollout", "status", "deploy/subscriber", "--timeout=120s")
    cluster.wait_ready(ns, "broker/default")
    ip: str = cluster.get(ns, "service/subscriber")["spec"]["clusterIP"]
    return ip


def trigger(cluster: Cluster, ns: str, name: str, event_type: str) -> None:
    cluster.apply(
        ns,
        json.dumps(
            {
                "apiVersion": "eventing.knative.dev/v1",
                "kind": "Trigger",
                "metadata": {"name": name},
                "spec": {
                    "broker": "default",
                    "filter": {"attributes": {"type": event_type}},
                    "subscriber": {
                        "ref": {"apiVersion": "v1", "kind": "Service", "name": "subscriber"}
                    },
                },
            }
        ),
    )
    cluster.wait_ready(ns, f"trigger/{name}")


def received(ip: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{ip}/events", timeout=5) as answer:
        events: list[dict[str, Any]] = json.load(answer)
    return events


def broker_ingress(cluster: Cluster, ns: str) -> str:
    """The Broker's address as the host reaches it: the ingress Service's ClusterIP."""
    ip = cluster.get("knative-eventing", "service/broker-ingress")["spec"]["clusterIP"]
    return f"http://{ip}/{ns}/default"


def sender_token(cluster: Cluster, ns: str, addressable: str) -> dict[str, str]:
    """`Authorization` with a token of the ServiceAccount `default` of `ns` for the
    addressable's audience; none when it has no audience (OIDC off)."""
    audience = cluster.get(ns, addressable)["status"].get("address", {}).get("audience")
    if not audience:
        return {}
    token = cluster.kubectl("-n", ns, "create", "token", "default", "--audience", audience)
    return {"authorization": f"Bearer {token.strip()}"}


def test_a_pod_runs(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl(
        "-n", namespace, "run", "hello", f"--image={cluster.python_image}",
        "--image-pull-policy=IfNotPresent", "--restart=Never", "--command", "--",
        "python3", "-c", "import socket; print('hello from', socket.gethostname())",
    )  # fmt: skip
    poll(
        "pod hello Succeeded",
        lambda: cluster.get(namespace, "pod/hello")["status"].get("phase") == "Succeeded",
        timeout=120,
    )
    assert "hello from hello" in cluster.kubectl("-n", namespace, "logs", "hello")


def test_broker_delivers_a_posted_event_to_a_trigger_subscriber(
    cluster: Cluster, namespace: str
) -> None:
    ip = broker_and_subscriber(cluster, namespace)
    trigger(cluster, namespace, "smoke", "dev.lapse.smoke.v1")
    url = broker_ingress(cluster, namespace)
    # With Eventing's authentication-oidc on (scripts/cluster/knative.sh), the Broker admits
    # a token for its audience from a ServiceAccount of its namespace (no EventPolicy: the
    # default authorization mode, allow-same-namespace).
    auth = sender_token(cluster, namespace, "broker/default")
    sent: list[str] = []

    def post_and_look() -> bool:
        # A Trigger is Ready a moment before the dispatcher has its subscription: post
        # again (a new id each time) until one arrives.
        event_id = f"smoke-{uuid.uuid4()}"
        request = urllib.request.Request(
            url,
            data=json.dumps({"hello": "cluster"}).encode(),
            method="POST",
            headers={
                "content-type": "application/json",
                "ce-specversion": "1.0",
                "ce-type": "dev.lapse.smoke.v1",
                "ce-source": "tests/cluster",
                "ce-id": event_id,
                **auth,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 202, answer.status
        except TimeoutError:
            # The Broker's ingress verifies each sender's token against the API server
            # (authentication-oidc); its first answers may take longer than this try.
            return False
        sent.append(event_id)
        time.sleep(1)
        return any(e.get("id") in sent for e in received(ip))

    poll("the posted event reaches the subscriber", post_and_look, timeout=120, interval=0)
    got = [e for e in received(ip) if e.get("id") in sent]
    assert got[0]["type"] == "dev.lapse.smoke.v1"
    assert json.loads(got[0]["data"]) == {"hello": "cluster"}
    print(f"delivered after {len(sent)} post(s)")


def test_apiserversource_delivers_an_add_event_through_the_broker(
    cluster: Cluster, namespace: str
) -> None:
    ip = broker_and_subscriber(cluster, namespace)
    trigger(cluster, namespace, "configmap-added", "dev.knative.apiserver.resource.add")
    rbac = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "watcher"}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "watch-configmaps"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                           "verbs": ["get", "list", "watch"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "watcher"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": "watch-configmaps"},
                "subjects": [{"kind": "ServiceAccount", "name": "watcher",
                              "namespace": namespace}],
            },
            {
                "apiVersion": "sources.knative.dev/v1",
                "kind": "ApiServerSource",
                "metadata": {"name": "configmaps"},
                "spec": {
                    "mode": "Resource",
                    "serviceAccountName": "watcher",
                    "resources": [{"apiVersion": "v1", "kind": "ConfigMap",
                                   "selector": {"matchLabels": {"smoke": "yes"}}}],
                    "sink": {"ref": {"apiVersion": "eventing.knative.dev/v1", "kind": "Broker",
                                     "name": "default"}},
                },
            },
        ],
    }  # fmt: skip
    cluster.apply(namespace, json.dumps(rbac))
    cluster.wait_ready(namespace, "apiserversource/configmaps", timeout=180)
    created: list[str] = []

    def create_and_look() -> bool:
        # The source emits nothing for objects that existed before its watch started, and
        # Ready can come a moment before the watch: create another until one is seen.
        name = f"cm-{len(created)}"
        configmap = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"},
                     "metadata": {"name": name, "labels": {"smoke": "yes"}}}  # fmt: skip
        cluster.kubectl("-n", namespace, "create", "-f", "-", stdin=json.dumps(configmap))
        created.append(name)
        time.sleep(2)
        return any(
            e.get("type") == "dev.knative.apiserver.resource.add"
            and json.loads(e["data"])["metadata"]["name"] in created
            for e in received(ip)
        )

    poll("an add event for a ConfigMap reaches the subscriber", create_and_look, 90, 0)
    event = next(e for e in received(ip) if e.get("type") == "dev.knative.apiserver.resource.add")
    obj = json.loads(event["data"])
    assert obj["kind"] == "ConfigMap"
    assert obj["metadata"]["namespace"] == namespace
    print(f"add event after {len(created)} ConfigMap(s), source {event.get('source')}")


HELLO = r"""
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "5")
        self.end_headers(); self.wfile.write(b"hello")
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("", int(os.environ["PORT"])), H).serve_forever()
"""


def test_a_knative_service_scales_from_zero_on_a_request(cluster: Cluster, namespace: str) -> None:
    if not cluster.kubectl(
        "get", "namespace", "knative-serving", "--ignore-not-found", "-o", "name"
    ):
        pytest.skip("Serving is not installed: make cluster CLUSTER_KNATIVE='eventing serving'")
    service = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": "hello"},
        "spec": {
            "template": {
                "metadata": {
                    "annotations": {
                        "autoscaling.knative.dev/min-scale": "0",
                        "autoscaling.knative.dev/window": "6s",
                    }
                },
                "spec": {
                    "containers": [
                        {
                            # from the local registry: Serving skips resolving its digest
                            # (config-deployment), containerd pulls it over plain http
                            "image": cluster.python_image,
                            "command": ["python3", "-u", "-c", HELLO],
                        }
                    ]
                },
            }
        },
    }
    cluster.apply(namespace, json.dumps(service))
    cluster.wait_ready(namespace, "ksvc/hello", timeout=180)
    host = cluster.get(namespace, "ksvc/hello")["status"]["url"].split("://", 1)[1]
    # No domain is configured, so the route is cluster-local (*.svc.cluster.local), served by
    # Kourier's internal gateway.
    gateway = cluster.get("kourier-system", "service/kourier-internal")["spec"]["clusterIP"]

    def serving_pods() -> list[Any]:
        items = cluster.get(namespace, "pods")["items"]
        return [p for p in items if "deletionTimestamp" not in p["metadata"]]

    # scaled to zero: no pod left that is not terminating (the 6 s window, then Serving's
    # scale-to-zero grace period)
    poll("hello scaled to zero", lambda: not serving_pods(), timeout=180, interval=1)
    start = time.monotonic()
    request = urllib.request.Request(f"http://{gateway}/", headers={"Host": host})
    with urllib.request.urlopen(request, timeout=60) as answer:
        body = answer.read()
    cold_start = time.monotonic() - start
    assert body == b"hello"
    assert serving_pods(), "the request was answered by a new pod"
    print(f"scale from zero through Kourier and the activator: {cold_start:.2f} s")
