"""Every Trigger that delivers to a lapse function names the audience that function checks
(lapse/runtime/senders.py): a Trigger without one sends a token the function refuses (401),
and the Broker then dead-letters every event of its type. Reference-mode Triggers were added
without one once, and only the cluster test noticed."""

from __future__ import annotations

from typing import Any

import yaml

from lapse import infra
from lapse.runtime.routing import TRIGGER_FILES


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(infra.read_text(name)) if d]


def test_each_trigger_to_a_function_names_the_audience_that_function_checks() -> None:
    checked: dict[str, str] = {}
    services = [
        s
        for name in ("knative/functions.yaml", "components/artifacts/service.yaml")
        for s in _documents(name)
        if s["kind"] == "Service"
    ]
    for service in services:
        env = service["spec"]["template"]["spec"]["containers"][0]["env"]
        [audience] = [e["value"] for e in env if e["name"] == "LAPSE_SENDER_AUDIENCE"]
        checked[service["metadata"]["name"]] = audience
    triggers = [t for name in TRIGGER_FILES for t in _documents(name)]
    to_functions = [
        t for t in triggers if t["spec"]["subscriber"].get("ref", {}).get("name") in checked
    ]
    assert to_functions, "no Trigger delivers to a lapse function"
    wrong = {
        t["metadata"]["name"]: t["spec"]["subscriber"].get("audience")
        for t in to_functions
        if t["spec"]["subscriber"].get("audience")
        != checked[t["spec"]["subscriber"]["ref"]["name"]]
    }
    assert wrong == {}
