"""infra/otel/collector.yaml on a real OpenTelemetry Collector (built from
infra/otel/builder-config.yaml): it validates, and it runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability import COLLECTOR_CONFIG, Binaries, Collector, binaries, http_get, loopback

pytestmark = pytest.mark.observability


@pytest.fixture(scope="module")
def tools() -> Binaries:
    return binaries()


def validate(tools: Binaries, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.otelcol), "validate", f"--config={config}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_collector_validates_the_shipped_configuration(tools: Binaries) -> None:
    result = validate(tools, COLLECTOR_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validation_rejects_a_pipeline_with_an_undefined_exporter(
    tools: Binaries, tmp_path: Path
) -> None:
    broken = tmp_path / "collector.yaml"
    broken.write_text(
        COLLECTOR_CONFIG.read_text().replace("exporters: [prometheus]", "exporters: [prometheus/x]")
    )
    result = validate(tools, broken)
    assert result.returncode != 0
    assert "prometheus/x" in result.stdout + result.stderr


def test_the_collector_runs_the_shipped_configuration(tools: Binaries, tmp_path: Path) -> None:
    collector = Collector(tools.otelcol, tmp_path, traces_endpoint=loopback(1))
    collector.start()
    try:
        # Up: the health check answers, and the Prometheus exporter serves (nothing yet).
        status, _ = http_get(f"http://{loopback(collector.prometheus)}/metrics")
        assert status == 200
        assert collector.process is not None and collector.process.poll() is None
    finally:
        collector.stop()
    assert "Everything is ready" in collector.log(), collector.log()[-2000:]


def test_the_built_collector_has_exactly_the_components_the_configuration_uses(
    tools: Binaries,
) -> None:
    result = subprocess.run(
        [str(tools.otelcol), "components"], capture_output=True, text=True, timeout=60, check=True
    )
    built = yaml.safe_load(result.stdout)
    config = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    for section in ("receivers", "processors", "exporters", "extensions"):
        have = {component["name"] for component in built.get(section) or []}
        used = {component_id.split("/")[0] for component_id in config.get(section) or {}}
        assert have == used, f"{section}: built {sorted(have)}, collector.yaml uses {sorted(used)}"
