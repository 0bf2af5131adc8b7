"""lapse's alert rules through the real promtool: they parse, and each fires (and stays
quiet) as its unit tests in tests/alerts/alerts_test.yaml say. The rules are the
PrometheusRule's spec (infra/otel/prometheusrule.yaml, their one source), written out as the
plain rules file a Prometheus without the Operator loads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.observability import ALERT_TESTS, Binaries, alert_rules, binaries

pytestmark = pytest.mark.observability


@pytest.fixture(scope="module")
def tools() -> Binaries:
    return binaries()


def promtool(tools: Binaries, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.promtool), *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    """alerts.yaml and, beside it, alerts_test.yaml (whose rule_files names it)."""
    (tmp_path / "alerts_test.yaml").write_text(ALERT_TESTS.read_text())
    return alert_rules(tmp_path)


def test_promtool_checks_the_rules(tools: Binaries, rules: Path) -> None:
    result = promtool(tools, "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout + result.stderr


def test_the_rules_pass_their_unit_tests(tools: Binaries, rules: Path) -> None:
    result = promtool(tools, "test", "rules", str(rules.parent / "alerts_test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_would_catch_a_rule_that_fires_wrongly(tools: Binaries, rules: Path) -> None:
    # The unit tests bite: the same tests against a rule with a broken threshold fail.
    broken = rules.read_text().replace("> 300", "> 3000")
    assert broken != rules.read_text()
    rules.write_text(broken)
    result = promtool(tools, "test", "rules", str(rules.parent / "alerts_test.yaml"))
    assert result.returncode != 0
    assert "LapseDeletionsLate" in result.stdout + result.stderr
