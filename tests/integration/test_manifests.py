"""infra/ manifests against the real schemas: Knative's CRDs at a pinned release, and the
kube-apiserver's own RBAC and core APIs.

Every object in infra/knative and infra/rbac is created with a server-side dry run, so the
API server validates it (strict field validation) without storing anything. The rest checks
the wiring between files: Triggers name real functions, functions name real ServiceAccounts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from lapse.embedded.kube import go_module_dir
from lapse.embedded.process import ServerStartError
from lapse.runtime.registry import FUNCTIONS
from tests.conftest import KubeStack, install_crd

KNATIVE_EVENTING_MODULE = "knative.dev/eventing"
# The newest knative.dev/eventing release the Go module proxy serves (Knative 1.20).
KNATIVE_EVENTING_VERSION = "v0.47.0"
# CRD file (under config/core/resources) for each Knative kind lapse's manifests use.
KNATIVE_CRD_FILES = {
    ("eventing.knative.dev", "Broker"): "broker.yaml",
    ("eventing.knative.dev", "Trigger"): "trigger.yaml",
    ("sources.knative.dev", "ApiServerSource"): "apiserversource.yaml",
}

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
MANIFEST_FILES = sorted((INFRA / "knative").glob("*.yaml")) + sorted(
    (INFRA / "rbac").glob("*.yaml")
)


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in MANIFEST_FILES:
        for doc in documents(path):
            yield path, doc


def group_of(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def knative_crds() -> dict[tuple[str, str], dict[str, Any]]:
    """The pinned Knative CRDs, keyed by (group, kind). Fails (never skips) without them."""
    try:
        module = go_module_dir(KNATIVE_EVENTING_MODULE, KNATIVE_EVENTING_VERSION)
    except ServerStartError as exc:
        pytest.fail(
            f"cannot read Knative's CRDs: {KNATIVE_EVENTING_MODULE}@{KNATIVE_EVENTING_VERSION} "
            f"did not download from the Go module proxy ({exc})"
        )
    crds = {}
    for key, name in KNATIVE_CRD_FILES.items():
        (crd,) = documents(module / "config/core/resources" / name)
        spec = crd["spec"]
        assert (spec["group"], spec["names"]["kind"]) == key, f"{name} defines another kind"
        crds[key] = crd
    return crds


def schema_of(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version and v["served"]:
            schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"{crd['metadata']['name']} does not serve {version}")


def unknown_fields(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Fields the schema does not declare, even below x-kubernetes-preserve-unknown-fields
    (where the API server keeps anything, so a misspelt field would pass unnoticed)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in ("apiVersion", "kind", "metadata") and not where:
                continue
            if key not in schema["properties"]:
                found.append(f"{where}.{key}")
            else:
                found += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{where}[{i}]")
    return found


def reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.body)


def test_every_manifest_declares_only_schema_fields() -> None:
    crds = knative_crds()
    checked = 0
    for path, doc in manifests():
        key = (group_of(doc["apiVersion"]), doc["kind"])
        if key not in crds:
            continue
        schema = schema_of(crds[key], doc["apiVersion"].rpartition("/")[2])
        name = doc["metadata"]["name"]
        assert unknown_fields(doc, schema) == [], f"{path.name}: {doc['kind']} {name}"
        checked += 1
    # Broker, ApiServerSource and at least one Trigger.
    assert checked >= 3


@pytest.mark.kube
def test_every_manifest_passes_server_side_dry_run(kube: KubeStack) -> None:
    for crd in knative_crds().values():
        try:
            install_crd(kube.api_client, crd)
        except ApiException as exc:  # another test of the session installed it already
            if exc.status != 409:
                raise
    namespace = kube.namespace("lapse-manifests")
    dynamic = DynamicClient(kube.api_client)

    rejected, accepted = [], []
    for path, doc in manifests():
        body = copy.deepcopy(doc)
        resource = dynamic.resources.get(api_version=body["apiVersion"], kind=body["kind"])
        if resource.namespaced:
            body["metadata"]["namespace"] = namespace
        for subject in body.get("subjects", []):
            if subject["kind"] == "ServiceAccount":
                subject["namespace"] = namespace
        label = f"{path.relative_to(INFRA)}: {body['kind']} {body['metadata']['name']}"
        try:
            created = resource.create(
                body=body,
                namespace=body["metadata"].get("namespace"),
                dry_run="All",
                query_params=[("fieldValidation", "Strict")],
            )
        except ApiException as exc:
            rejected.append(f"{label}: {exc.status} {reason(exc)}")
            continue
        assert created.metadata.name == body["metadata"]["name"], label
        accepted.append((resource, body))
    assert rejected == []

    kinds = {body["kind"] for _, body in accepted}
    assert {"Broker", "Trigger", "ApiServerSource", "ServiceAccount", "ClusterRole"} <= kinds
    # A dry run stores nothing.
    for resource, body in accepted:
        if resource.namespaced:
            assert resource.get(namespace=namespace).items == [], body["kind"]
        else:
            with pytest.raises(ApiException) as missing:
                resource.get(name=body["metadata"]["name"])
            assert missing.value.status == 404


def test_every_trigger_delivers_to_a_function_through_the_broker() -> None:
    (broker,) = documents(INFRA / "knative/broker.yaml")
    triggers = documents(INFRA / "knative/triggers.yaml")
    assert triggers
    for trigger in triggers:
        name = trigger["metadata"]["name"]
        assert trigger["kind"] == "Trigger", name
        assert trigger["spec"]["broker"] == broker["metadata"]["name"], name
        ref = trigger["spec"]["subscriber"]["ref"]
        assert (ref["apiVersion"], ref["kind"]) == ("serving.knative.dev/v1", "Service"), name
        prefix, _, function = ref["name"].partition("-")
        assert (prefix, function in FUNCTIONS) == ("lapse", True), f"{name} → {ref['name']}"


def test_apiserversource_feeds_the_broker() -> None:
    (broker,) = documents(INFRA / "knative/broker.yaml")
    (source,) = documents(INFRA / "knative/apiserversource.yaml")
    sink = source["spec"]["sink"]["ref"]
    assert (sink["kind"], sink["name"]) == ("Broker", broker["metadata"]["name"])
    assert source["metadata"]["namespace"] == broker["metadata"]["namespace"]


def test_every_function_runs_as_a_declared_service_account() -> None:
    service_accounts = {
        (doc["metadata"]["namespace"], doc["metadata"]["name"])
        for path in sorted((INFRA / "rbac").glob("*.yaml"))
        for doc in documents(path)
        if (doc["apiVersion"], doc["kind"]) == ("v1", "ServiceAccount")
    }
    func_yamls = sorted((ROOT / "functions").glob("*/func.yaml"))
    assert func_yamls
    for func_yaml in func_yamls:
        (func,) = documents(func_yaml)
        account = func["deploy"]["serviceAccountName"]
        assert ("lapse-system", account) in service_accounts, func_yaml
    # The single-process deployment and the ApiServerSource have theirs too.
    (source,) = documents(INFRA / "knative/apiserversource.yaml")
    assert ("lapse-system", source["spec"]["serviceAccountName"]) in service_accounts
    assert ("lapse-system", "lapse") in service_accounts


@pytest.mark.kube
def test_strict_dry_run_rejects_a_misspelt_field(kube: KubeStack) -> None:
    """The dry run above would catch a typo: the server refuses unknown fields."""
    namespace = kube.namespace("lapse-manifests")
    dynamic = DynamicClient(kube.api_client)
    roles = dynamic.resources.get(api_version="rbac.authorization.k8s.io/v1", kind="Role")
    body = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "typo", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["events"], "verb": ["create"]}],
    }
    with pytest.raises(ApiException) as refused:
        roles.create(
            body=body,
            namespace=namespace,
            dry_run="All",
            query_params=[("fieldValidation", "Strict")],
        )
    assert refused.value.status in (400, 422)
