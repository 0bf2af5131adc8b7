"""lapse's alert rules through the real promtool: they parse, and each fires (and stays
quiet) as its unit tests in infra/otel/alerts_test.yaml say."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.observability import ALERT_RULES, ALERT_TESTS, Binaries, binaries

pytestmark = pytest.mark.observability


@pytest.fixture(scope="module")
def tools() -> Binaries:
    return binaries()


def promtool(tools: Binaries, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.promtool), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_checks_the_rules(tools: Binaries) -> None:
    result = promtool(tools, "check", "rules", str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout + result.stderr


def test_the_rules_pass_their_unit_tests(tools: Binaries) -> None:
    result = promtool(tools, "test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_would_catch_a_rule_that_fires_wrongly(tools: Binaries, tmp_path: Path) -> None:
    # The unit tests bite: the same tests against a rule with a broken threshold fail.
    broken = ALERT_RULES.read_text().replace("> 300", "> 3000")
    assert broken != ALERT_RULES.read_text()
    (tmp_path / "alerts.yaml").write_text(broken)
    (tmp_path / "alerts_test.yaml").write_text(ALERT_TESTS.read_text())
    result = promtool(tools, "test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert result.returncode != 0
    assert "LapseDeletionsLate" in result.stdout + result.stderr
