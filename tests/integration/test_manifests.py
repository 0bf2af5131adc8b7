"""The wiring between infra/ files that lapse itself reads and the function folders:
Triggers name real functions through the Broker, functions name real ServiceAccounts.

Every object the package renders is validated against the real kube-apiserver and the
pinned Knative CRDs in test_infra_package.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lapse.runtime.registry import FUNCTIONS
from lapse.runtime.routing import TRIGGER_FILES

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_every_trigger_delivers_to_a_function_through_the_broker() -> None:
    (broker,) = documents(INFRA / "knative/broker.yaml")
    # Every Trigger lapse ships: the Knative path's and the opt-in Components' (`lapse up`
    # routes all of them: lapse/runtime/routing.py).
    triggers = [t for path in TRIGGER_FILES for t in documents(INFRA / path)]
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
        for path in [
            *sorted((INFRA / "rbac").glob("*.yaml")),
            INFRA / "single-process/rbac.yaml",
            # an opt-in function's own, beside its Service (infra/components/artifacts)
            *sorted((INFRA / "components").glob("*/service.yaml")),
        ]
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
