"""infra/otel/: the alert rules have one source, the PrometheusRule (no second copy to drift),
and every rule has a unit test in tests/alerts/alerts_test.yaml (run by promtool in
tests/integration/test_alert_rules.py on the PrometheusRule's spec)."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from lapse import infra
from tests.observability import ALERT_TESTS

OPERATOR: dict[str, Any] = yaml.safe_load(infra.read_text("otel/prometheusrule.yaml"))
RULES: dict[str, Any] = OPERATOR["spec"]
UNIT_TESTS: dict[str, Any] = yaml.safe_load(ALERT_TESTS.read_text())


def alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_prometheusrule_is_the_only_copy_of_the_rules() -> None:
    assert OPERATOR["apiVersion"] == "monitoring.coreos.com/v1"
    assert OPERATOR["kind"] == "PrometheusRule"
    assert OPERATOR["metadata"]["name"] == "lapse"
    # Its spec is a plain rules file: only `groups`, as Prometheus's rule_files take it.
    assert set(RULES) == {"groups"}
    otel = resources.files(infra).joinpath("otel")
    rule_files = [
        entry.name
        for entry in otel.iterdir()
        if entry.name.endswith(".yaml") and "groups" in (yaml.safe_load(entry.read_text()) or {})
    ]
    assert rule_files == [], f"a second copy of the alert rules: {rule_files}"


def test_lapse_ships_the_alerts_operators_need() -> None:
    assert set(alert_names(RULES["groups"])) == {
        "LapseDeadLettersGrowing",
        "LapseMassDeletionBrakeEngaged",
        "LapseDeletionsFailing",
        "LapseWaitingOnOutage",
        "LapseDeletionsLate",
    }
    for group in RULES["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in UNIT_TESTS["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    # The rules file the tests write next to it (tests/observability.py, alert_rules).
    assert UNIT_TESTS["rule_files"] == ["alerts.yaml"]
    assert fired == quiet == set(alert_names(RULES["groups"]))
