"""The kustomize package (infra/overlays/dev, production, single-process), as a user
installs it: rendered by kubectl, accepted by the real kube-apiserver (server-side dry run,
strict field validation) with the pinned Knative Serving/Eventing and Argo CRDs installed,
and wired together: every name an object references is shipped by the package or is one of
the documented Secrets, and the one list of cleaned namespaces agrees everywhere."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.embedded.nats_identities import (
    ADMIN,
    ARTIFACT_REAPER,
    BRIDGE,
    DLQ_SINK,
    KUBERNETES,
    OBJECT_REAPER,
    PLANNER,
    PROCESS,
    ROW_REAPER,
    USERS_SECRET,
    kubernetes_conf,
    password_variable,
)
from lapse.runtime.consumers import owned_durables, retired_durables
from tests.conftest import KubeStack
from tests.infra_package import (
    INFRA,
    OVERLAYS,
    ROOT,
    install_crds,
    knative_crds,
    kubectl,
    prometheus_operator_crds,
    rendered,
    rendered_text,
    rendered_with_components,
    schema_of,
    unknown_fields,
)

# The Secrets the user creates (docs/deploy.md), or the dev NATS's Job generates
# (lapse-nats-users); the package ships none.
DOCUMENTED_SECRETS = {
    "lapse-database", "lapse-nats-users", "lapse-nats-tls", "lapse-ingress", "lapse-artifacts",
}  # fmt: skip
# Functions deployed only by an opt-in Component (infra/components/<name>), by Service.
OPT_IN = {"lapse-artifact-reaper": "artifacts"}
KNATIVE_PATH = ("dev", "production")


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in rendered(overlay) if doc["kind"] == kind]


def names(overlay: str, kind: str) -> set[str]:
    return {doc["metadata"]["name"] for doc in objects(overlay, kind)}


def pod_specs(overlay: str) -> Iterator[tuple[str, dict[str, Any]]]:
    return pod_specs_of(rendered(overlay))


def pod_specs_of(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job") or (
            doc["kind"] == "Service" and doc["apiVersion"].startswith("serving.knative.dev")
        ):
            yield f"{doc['kind']} {doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def lapse_yaml(overlay: str) -> dict[str, Any]:
    (config,) = [c for c in objects(overlay, "ConfigMap") if c["metadata"]["name"] == "lapse"]
    loaded: dict[str, Any] = yaml.safe_load(config["data"]["lapse.yaml"])
    return loaded


@pytest.mark.kube
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_a_strict_server_side_dry_run(
    kube: KubeStack, overlay: str
) -> None:
    assert_a_strict_dry_run_accepts(kube, rendered(overlay))


@pytest.mark.kube
def test_the_artifacts_component_passes_the_same_dry_run(kube: KubeStack, tmp_path: Path) -> None:
    assert_a_strict_dry_run_accepts(kube, rendered_with_components("dev", ["artifacts"], tmp_path))


def assert_a_strict_dry_run_accepts(
    kube: KubeStack, rendered_objects: list[dict[str, Any]]
) -> None:
    install_crds(kube.api_client, knative_crds() + prometheus_operator_crds())
    # The namespaces must exist for a dry run of what goes in them (a dry-run Namespace is
    # not stored); the test API server is thrown away after the session.
    for namespace in {d["metadata"].get("namespace") for d in rendered_objects} - {None}:
        kube.namespace(namespace)
    out = subprocess.run(
        [
            str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side",
            "--field-manager=lapse-test", "--dry-run=server", "--validate=strict", "-f", "-",
        ],
        input=yaml.safe_dump_all(rendered_objects), capture_output=True, text=True,
        env={**os.environ, "KUBECONFIG": str(kube.kubeconfig)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(rendered_objects), out.stdout
    # A dry run stores nothing.
    with pytest.raises(ApiException) as missing:
        client.CoreV1Api(kube.api_client).read_namespaced_config_map("lapse", "lapse-system")
    assert missing.value.status == 404


@pytest.mark.kube
def test_a_misspelt_field_is_refused_by_the_same_dry_run(kube: KubeStack) -> None:
    """The dry run above refuses unknown fields (strict validation) where the schema is
    closed, as for a Deployment. Knative's CRDs keep any field under `spec`
    (x-kubernetes-preserve-unknown-fields), so their objects are checked against the
    declared schema by the next test instead."""
    kube.namespace("lapse-system")
    (bridge,) = [d for d in objects("dev", "Deployment") if d["metadata"]["name"] == "lapse-bridge"]
    bridge["spec"]["replica"] = bridge["spec"].pop("replicas")
    out = subprocess.run(
        [
            str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side",
            "--dry-run=server", "--validate=strict", "-f", "-",
        ],
        input=yaml.safe_dump(bridge), capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0
    assert "replica" in out.stderr


@pytest.mark.parametrize("overlay", KNATIVE_PATH)
def test_knative_objects_declare_only_schema_fields(overlay: str) -> None:
    """Also below x-kubernetes-preserve-unknown-fields (a Trigger's `delivery`, say), where
    the API server keeps anything, so a misspelt field would pass the dry run unnoticed."""
    # Broker, 3 Triggers (one per function), ApiServerSource, SinkBinding, Services
    assert knative_objects_declare_only_schema_fields(rendered(overlay)) >= 10


def knative_objects_declare_only_schema_fields(docs: list[dict[str, Any]]) -> int:
    crds = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in knative_crds()}
    checked = 0
    for doc in docs:
        group, _, version = doc["apiVersion"].rpartition("/")
        if (group, doc["kind"]) not in crds:
            continue
        schema = schema_of(crds[(group, doc["kind"])], version)
        assert unknown_fields(doc, schema) == [], f"{doc['kind']} {doc['metadata']['name']}"
        checked += 1
    return checked


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_is_shipped_or_a_documented_secret(overlay: str) -> None:
    config_maps = names(overlay, "ConfigMap")
    accounts = names(overlay, "ServiceAccount")
    secrets_used = set()
    for label, spec in pod_specs(overlay):
        assert spec.get("serviceAccountName") in accounts | {None}, label
        if "serviceAccountName" not in spec:
            assert spec.get("automountServiceAccountToken") is False, label
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, label
            if "secret" in volume:
                secrets_used.add(volume["secret"]["secretName"])
        for container in spec["containers"]:
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    assert source["configMapKeyRef"]["name"] in config_maps, label
                if "secretKeyRef" in source:
                    secrets_used.add(source["secretKeyRef"]["name"])
    assert secrets_used <= DOCUMENTED_SECRETS
    assert names(overlay, "Secret") == set(), "the package ships no credentials"
    services = names(overlay, "Service")
    for doc in rendered(overlay):
        delivery = doc.get("spec", {}).get("delivery", {})
        if "deadLetterSink" in delivery:
            assert delivery["deadLetterSink"]["ref"]["name"] in services
    for binding in objects(overlay, "RoleBinding") + objects(overlay, "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            assert subject["name"] in accounts, binding["metadata"]["name"]
            assert subject["namespace"] == "lapse-system"


@pytest.mark.parametrize("overlay", KNATIVE_PATH)
def test_the_knative_path_is_complete(overlay: str) -> None:
    docs = rendered(overlay)
    (broker,) = objects(overlay, "Broker")
    (source,) = objects(overlay, "ApiServerSource")
    (binding,) = objects(overlay, "SinkBinding")
    assert source["spec"]["sink"]["ref"]["name"] == broker["metadata"]["name"]
    assert binding["spec"]["sink"]["ref"]["name"] == broker["metadata"]["name"]
    assert binding["spec"]["subject"]["name"] in names(overlay, "Deployment")
    kinds = {(r["apiVersion"], r["kind"]) for r in source["spec"]["resources"]}
    # Jobs, and the engines the overlay includes a Component for (infra/components/kinds):
    # Argo in both; the production overlay's Tekton and Trainer lines are for the user.
    assert kinds == {("argoproj.io/v1alpha1", "Workflow"), ("batch/v1", "Job")}
    # Every Trigger outlasts an outage and ends in the dead-letter sink, never dropped.
    triggers = objects(overlay, "Trigger")
    assert triggers
    for trigger in triggers:
        delivery = trigger["spec"]["delivery"]
        assert delivery["retry"] >= 100 and delivery["backoffPolicy"] == "linear"
        assert delivery["deadLetterSink"]["ref"]["name"] == "lapse-dlq-sink"
    # Each function reads lapse.yaml where its func.yaml says.
    for func_yaml in sorted((ROOT / "functions").glob("*/func.yaml")):
        env = {
            e["name"]: e.get("value") for e in yaml.safe_load(func_yaml.read_text())["run"]["envs"]
        }
        assert env["LAPSE_CONFIG"] == "/etc/lapse/lapse.yaml", func_yaml
    for label, spec in pod_specs(overlay):
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if label.startswith("Deployment nats") or label == "Job lapse-nats-users":
            continue  # the NATS server, and the Job making its passwords: no lapse.yaml
        assert env["LAPSE_CONFIG"] == "/etc/lapse/lapse.yaml", label
        assert {"name": "config", "mountPath": "/etc/lapse", "readOnly": True} in container[
            "volumeMounts"
        ], label
    assert "lapse-streams" in names(overlay, "Deployment")  # the streams
    # Each lapse process takes the NATS URL from the ConfigMap's nats-url, written once.
    for label, spec in pod_specs(overlay):
        if label.startswith("Deployment nats") or label == "Job lapse-nats-users":
            continue
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["LAPSE_NATS__URL"]["valueFrom"] == {
            "configMapKeyRef": {"name": "lapse", "key": "nats-url"}
        }, label
    assert "url" not in lapse_yaml(overlay)["nats"]
    assert docs


@pytest.mark.parametrize("overlay", KNATIVE_PATH)
def test_every_trigger_reaches_a_function_the_package_deploys(overlay: str) -> None:
    """By default every function but the opt-in ones, and no Trigger for those: nothing a
    default install waits on to become Ready is missing."""
    assert_triggers_reach_the_functions(rendered(overlay), set(OPT_IN))


def assert_triggers_reach_the_functions(docs: list[dict[str, Any]], left_out: set[str]) -> None:
    services = {
        s["metadata"]["name"]: s
        for s in docs
        if s["kind"] == "Service" and s["apiVersion"].startswith("serving.knative.dev")
    }
    accounts = {a["metadata"]["name"]: a for a in docs if a["kind"] == "ServiceAccount"}
    for trigger in (d for d in docs if d["kind"] == "Trigger"):
        assert trigger["spec"]["subscriber"]["ref"]["name"] in services, trigger["metadata"]
    # The Services are the ones `func deploy` would make from the function folders: same
    # names, same ServiceAccounts, each one the package declares.
    functions = {}
    for func_yaml in sorted((ROOT / "functions").glob("*/func.yaml")):
        spec = yaml.safe_load(func_yaml.read_text())
        if spec["name"] not in left_out:
            functions[spec["name"]] = spec["deploy"]["serviceAccountName"]
    by_service = {
        n: s["spec"]["template"]["spec"]["serviceAccountName"] for n, s in services.items()
    }
    assert by_service == functions
    assert set(by_service.values()) <= set(accounts)


@pytest.mark.parametrize("overlay", KNATIVE_PATH)
def test_the_artifacts_component_adds_the_artifact_reaper_whole(
    overlay: str, tmp_path: Path
) -> None:
    """infra/components/artifacts: Trigger → Service → ServiceAccount, shaped like the
    row-reaper (what infra/knative's patches give every function, written into the
    Component, must stay what they give), and allowed where the functions are."""
    docs = rendered_with_components(overlay, ["artifacts"], tmp_path)
    assert_triggers_reach_the_functions(docs, set())
    assert knative_objects_declare_only_schema_fields(docs) >= 12  # + its Trigger, Service

    def one(kind: str, name: str) -> dict[str, Any]:
        (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return found

    trigger, rows = one("Trigger", "artifact-reaper-due"), one("Trigger", "row-reaper-due")
    assert trigger["spec"]["delivery"] == rows["spec"]["delivery"]
    assert trigger["spec"]["filter"]["attributes"]["target"] == "artifacts"
    account = one("ServiceAccount", "lapse-artifact-reaper")
    # Its API token is for its one list of Workflows (test_rbac.py); the row-reaper has none.
    assert "automountServiceAccountToken" not in account
    assert one("ServiceAccount", "lapse-row-reaper")["automountServiceAccountToken"] is False

    def pod(name: str) -> dict[str, Any]:
        service = one("Service", name)
        assert service["metadata"]["labels"]["networking.knative.dev/visibility"] == "cluster-local"
        text = yaml.safe_dump(service["spec"]["template"])
        return dict(yaml.safe_load(text.replace(name, "lapse-FUNCTION")))

    artifacts, row = pod("lapse-artifact-reaper"), pod("lapse-row-reaper")
    (a,), (r,) = artifacts["spec"]["containers"], row["spec"]["containers"]
    assert a.pop("envFrom") == [
        *r.pop("envFrom"),
        {"secretRef": {"name": "lapse-artifacts", "optional": True}},
    ]
    assert a.pop("image").endswith("/artifact-reaper:" + r.pop("image").rsplit(":", 1)[1])
    a_env = {e["name"]: e for e in a.pop("env")}
    r_env = {e["name"]: e for e in r.pop("env")}
    assert a_env == {k: v for k, v in r_env.items() if k != "LAPSE_DATABASE__URL"}
    # The rest, volumes, mounts, probes, securityContext, annotations, is the row-reaper's.
    assert (artifacts, a) == (row, r)

    (policy,) = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "lapse-functions"
    ]
    (selector,) = policy["spec"]["podSelector"]["matchExpressions"]
    assert "lapse-artifact-reaper" in selector["values"]
    binding = one("ClusterRoleBinding", "lapse-tokenreview")
    assert {
        "kind": "ServiceAccount",
        "name": "lapse-artifact-reaper",
        "namespace": "lapse-system",
    } in binding["subjects"]
    assert_nats_identities(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renamed_reaper_is_known_by_its_new_names_only(overlay: str) -> None:
    """workflow-reaper became object-reaper: the package uses only the new names (the old
    one survives in triggers.yaml only as the hint `lapse up` reads to move its consumer,
    and in nats.conf as the one thing `lapse` may still do to that consumer: delete it once
    its successor took over)."""
    retiring = '"$JS.API.CONSUMER.DELETE.*.lapse-workflow-reaper-due",'
    text = rendered_text(overlay).replace(retiring, "")
    assert "workflow-reaper" not in text and "workflow_reaper" not in text
    if overlay in KNATIVE_PATH:
        assert "object-reaper-due" in names(overlay, "Trigger")
        assert "lapse-object-reaper" in names(overlay, "ServiceAccount")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_list_of_cleaned_namespaces(overlay: str) -> None:
    """RBAC, the ApiServerSource and lapse's own scope name the same namespaces."""
    granted = {
        b["metadata"]["namespace"]
        for b in objects(overlay, "RoleBinding")
        if b["roleRef"]["name"] == "lapse-object-reaper"
    }
    assert granted and "kube-system" not in granted and "lapse-system" not in granted
    assert set(lapse_yaml(overlay)["safety"]["namespaces"]["include"]) == granted
    for source in objects(overlay, "ApiServerSource"):
        (expression,) = source["spec"]["namespaceSelector"]["matchExpressions"]
        assert expression["key"] == "kubernetes.io/metadata.name"
        assert set(expression["values"]) == granted


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nothing_may_delete_cluster_wide(overlay: str) -> None:
    for role in objects(overlay, "ClusterRole"):
        if role["metadata"]["name"] == "lapse-tokenreview":
            # The functions' one cluster-scoped right: reviewing their senders' tokens
            # (lapse/runtime/senders.py), reading nothing.
            assert role["rules"] == [
                {
                    "apiGroups": ["authentication.k8s.io"],
                    "resources": ["tokenreviews"],
                    "verbs": ["create"],
                }
            ]
            continue
        if role["metadata"]["name"] == "lapse-policy-editor":
            continue  # the tenants' role, bound per namespace only (checked below)
        for rule in role["rules"]:
            if role["metadata"]["name"] == "lapse-policy-reader" and rule["verbs"] == ["patch"]:
                # lapse's verdict on its own policy objects: their status, nothing else.
                assert rule["resources"] == [
                    "lapsepolicies/status",
                    "clusterlapsepolicies/status",
                ]
                continue
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, role["metadata"]["name"]
    bindings = objects(overlay, "ClusterRoleBinding")
    bound = {b["metadata"]["name"] for b in bindings}
    assert all(b["roleRef"]["name"] != "lapse-policy-editor" for b in bindings)
    # Only `lapse up`'s watchers (runs and policy objects) read cluster-wide; the Knative
    # path binds the token review there, and the reading of lapse's own policy objects
    # (the watcher; the planner and the object-reaper, read-only: infra/components/policies).
    single = {"lapse-watch", "lapse-policy-reader"}
    knative = {"lapse-tokenreview", "lapse-policy-reader", "lapse-policy-follower"}
    assert bound == (single if overlay == "single-process" else knative)


def test_production_keeps_what_production_needs() -> None:
    config = lapse_yaml("production")
    assert config["nats"]["replicas"] == 3
    assert "url" not in config.get("database", {})  # from the Secret, never the ConfigMap
    budgets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for p in objects("production", "PodDisruptionBudget")
    }
    assert budgets == {"lapse-bridge", "lapse-dlq-sink"}
    for label, spec in pod_specs("production"):
        (container,) = spec["containers"]
        assert container["resources"]["requests"], label
    for service in objects("production", "Service"):
        if service["apiVersion"].startswith("serving.knative.dev"):
            annotations = service["spec"]["template"]["metadata"]["annotations"]
            assert "autoscaling.knative.dev/max-scale" in annotations
    assert lapse_yaml("dev")["nats"]["replicas"] == 1


def test_every_kustomization_is_in_the_tree_it_documents() -> None:
    """infra/README.md names every kustomization folder; each renders on its own or is
    included by an overlay."""
    readme = (INFRA / "README.md").read_text()
    for kustomization in sorted(INFRA.rglob("kustomization.yaml")):
        folder = kustomization.parent.relative_to(INFRA).as_posix()
        if "/namespaces/" in folder:
            continue
        assert f"{folder}/" in readme, folder


# Each lapse workload and the NATS user it connects as (docs/deploy.md, "NATS identities").
NATS_USERS = {
    "Service lapse-ttl-planner": PLANNER.user,
    "Service lapse-object-reaper": OBJECT_REAPER.user,
    "Service lapse-row-reaper": ROW_REAPER.user,
    "Service lapse-artifact-reaper": ARTIFACT_REAPER.user,
    "Deployment lapse-bridge": BRIDGE.user,
    "Deployment lapse-dlq-sink": DLQ_SINK.user,
    "Deployment lapse": PROCESS.user,
    "Deployment lapse-streams": ADMIN.user,
    # It re-plans as the planner does (infra/components/policies/watcher.yaml).
    "Deployment lapse-policy-watcher": PLANNER.user,
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_lapse_pod_has_its_own_nats_identity_and_only_its_password(overlay: str) -> None:
    assert_nats_identities(rendered(overlay))


def assert_nats_identities(docs: list[dict[str, Any]]) -> None:
    seen = set()
    for label, spec in pod_specs_of(docs):
        if label in ("Deployment nats", "Job lapse-nats-users"):
            continue
        user = NATS_USERS[label]
        seen.add(label)
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["LAPSE_NATS__USER"]["value"] == user, label
        assert "LAPSE_NATS__PASSWORD" not in env, label  # a file, never the environment
        path = Path(env["LAPSE_NATS__PASSWORD_FILE"]["value"])
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (name,) = [n for n, m in mounts.items() if m["mountPath"] == str(path.parent)]
        assert mounts[name]["readOnly"] is True
        secret = volumes[name]["secret"]
        # Only its own key: a planner pod cannot read the admin's password.
        assert secret == {
            "secretName": USERS_SECRET,
            "items": [{"key": user, "path": path.name}],
        }, label
    assert seen == {label for label in NATS_USERS if label in dict(pod_specs_of(docs))}
    assert {i.user for i in KUBERNETES} >= set(NATS_USERS.values())


@pytest.mark.parametrize("overlay", ["dev", "single-process"])
def test_the_dev_nats_admits_only_lapses_identities(overlay: str) -> None:
    (conf,) = [
        c
        for c in objects(overlay, "ConfigMap")
        if c["metadata"]["name"].startswith("lapse-nats-conf")
    ]
    # The committed configuration is the one the identities module makes.
    assert conf["data"]["nats.conf"] == kubernetes_conf(owned_durables(), retired_durables())
    assert (INFRA / "dev-nats" / "nats.conf").read_text() == kubernetes_conf(
        owned_durables(), retired_durables()
    )
    (nats,) = [d for d in objects(overlay, "Deployment") if d["metadata"]["name"] == "nats"]
    (container,) = nats["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["-c", "/etc/nats/nats.conf"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {password_variable(i): {"name": USERS_SECRET, "key": i.user} for i in KUBERNETES}
    (job,) = [j for j in objects(overlay, "Job") if j["metadata"]["name"] == "lapse-nats-users"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == (
        "lapse.operations.nats_users"
    )
    (role,) = [r for r in objects(overlay, "Role") if r["metadata"]["name"] == "lapse-nats-users"]
    # Create any Secret (RBAC cannot name one not yet made); read and patch only its own.
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["lapse-nats-users"],
            "verbs": ["get", "patch"],
        },
    ]


def test_production_talks_tls_to_nats_with_per_identity_users() -> None:
    nats = lapse_yaml("production")["nats"]
    (config,) = [c for c in objects("production", "ConfigMap") if c["metadata"]["name"] == "lapse"]
    assert config["data"]["nats-url"].startswith("tls://")
    assert "user" not in nats and "password" not in nats  # per pod, from the Secret
    ca = Path(nats["tls"]["ca_file"])
    for label, spec in pod_specs("production"):
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = {v["name"]: v for v in spec["volumes"]}[mounts[str(ca.parent)]]
        assert volume["secret"] == {
            "secretName": "lapse-nats-tls",
            "items": [{"key": ca.name, "path": ca.name}],
        }, label
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["LAPSE_NATS__URL"]["valueFrom"]["configMapKeyRef"]["key"] == "nats-url"
