"""infra/otel/: the PrometheusRule (Prometheus Operator) carries exactly the rules of the plain
rules file, and every rule has a unit test in alerts_test.yaml (run by promtool in
tests/integration/test_alert_rules.py)."""

from __future__ import annotations

from typing import Any

import yaml

import infra

RULES: dict[str, Any] = yaml.safe_load(infra.read_text("otel/alerts.yaml"))
OPERATOR: dict[str, Any] = yaml.safe_load(infra.read_text("otel/prometheusrule.yaml"))
UNIT_TESTS: dict[str, Any] = yaml.safe_load(infra.read_text("otel/alerts_test.yaml"))


def alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_prometheusrule_is_the_rules_file() -> None:
    assert OPERATOR["apiVersion"] == "monitoring.coreos.com/v1"
    assert OPERATOR["kind"] == "PrometheusRule"
    assert OPERATOR["metadata"]["name"] == "lapse"
    assert OPERATOR["spec"] == RULES, (
        "infra/otel/prometheusrule.yaml differs from alerts.yaml: copy alerts.yaml's groups "
        "under spec:"
    )


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
    assert UNIT_TESTS["rule_files"] == ["alerts.yaml"]
    assert fired == quiet == set(alert_names(RULES["groups"]))
