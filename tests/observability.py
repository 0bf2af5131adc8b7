"""Real observability backends for the tests: an OpenTelemetry Collector, Prometheus and
Jaeger v2, built by scripts/build-observability.sh (cached by version) and started here on
free loopback ports with their state in a temporary directory.

Every listener each of them opens is named in its configuration and bound to 127.0.0.1:
their defaults (0.0.0.0, fixed ports such as 4317/8888/9090/13133/16686) would collide with
other tests and reach beyond this machine.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lapse.embedded.process import free_port, spawn, stop, wait_until

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "build-observability.sh"
COLLECTOR_CONFIG = REPO / "infra" / "otel" / "collector.yaml"
# The one source of lapse's alert rules; its `spec` is the plain rules file Prometheus loads.
PROMETHEUS_RULE = REPO / "infra" / "otel" / "prometheusrule.yaml"
# Its promtool unit tests: a test fixture, so under tests/ (not infra/, which the wheel ships).
ALERT_TESTS = REPO / "tests" / "alerts" / "alerts_test.yaml"


def alert_rules(folder: Path) -> Path:
    """The rules file a Prometheus without the Operator loads: the PrometheusRule's spec,
    written to `folder`/alerts.yaml (the name alerts_test.yaml's rule_files gives)."""
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    path = folder / "alerts.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@dataclass(frozen=True)
class Binaries:
    prometheus: Path
    promtool: Path
    otelcol: Path
    jaeger: Path


def binaries() -> Binaries:
    """The built binaries (`make observability` builds them; here a cached build is reused,
    so this is instant after it)."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"build-observability.sh failed:\n{result.stderr[-3000:]}")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    return Binaries(
        bin_dir / "prometheus", bin_dir / "promtool", bin_dir / "otelcol-lapse", bin_dir / "jaeger"
    )


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def loopback(port: int) -> str:
    return f"127.0.0.1:{port}"


class Server:
    """One backend process: configuration written, started, waited for, stopped."""

    name = "server"

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def args(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 60.0) -> None:
        self.process = spawn(self.args(), self.log_path)
        try:
            wait_until(
                self.ready,
                process=self.process,
                what=self.name,
                log_path=self.log_path,
                timeout=timeout,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def jaeger_config(
    *, otlp_grpc: str, otlp_http: str, query_http: str, query_grpc: str
) -> dict[str, Any]:
    """Jaeger v2 with in-memory storage listening on these host:port addresses (also how
    tests/cluster runs it in a pod)."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch"],
                    "exporters": ["jaeger_storage_exporter"],
                }
            },
            # Its own metrics would listen on 0.0.0.0:8888.
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memory": {"memory": {"max_traces": 100000}}}},
            "jaeger_query": {
                "storage": {"traces": "memory"},
                "http": {"endpoint": query_http},
                "grpc": {"endpoint": query_grpc},
                # On by default: it would trace itself to localhost:4317, which may be
                # another test's Collector.
                "enable_tracing": False,
            },
        },
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": otlp_grpc},
                    "http": {"endpoint": otlp_http},
                }
            }
        },
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory"}},
    }


class Jaeger(Server):
    """Jaeger v2 with in-memory storage: OTLP in (gRPC and HTTP), the query API out."""

    name = "jaeger"

    def __init__(self, binary: Path, work_dir: Path) -> None:
        super().__init__(work_dir)
        self.binary = binary
        self.otlp_grpc = free_port()
        self.otlp_http = free_port()
        self.query_http = free_port()
        self.query_grpc = free_port()
        self.config = work_dir / "jaeger.yaml"

    def args(self) -> list[str]:
        config = jaeger_config(
            otlp_grpc=loopback(self.otlp_grpc),
            otlp_http=loopback(self.otlp_http),
            query_http=loopback(self.query_http),
            query_grpc=loopback(self.query_grpc),
        )
        self.config.write_text(yaml.safe_dump(config))
        return [str(self.binary), "--config", str(self.config)]

    def ready(self) -> bool:
        return http_get(f"http://{loopback(self.query_http)}/api/v3/services")[0] == 200

    def traces(self, service: str, since: float, until: float) -> dict[str, Any]:
        """Every trace of `service` that started between two Unix times (OTLP JSON)."""
        return jaeger_traces(loopback(self.query_http), service, since, until)


def jaeger_traces(query: str, service: str, since: float, until: float) -> dict[str, Any]:
    """Every trace of `service` that started between two Unix times (OTLP JSON), from the
    query API of a Jaeger at `query` (host:port)."""
    parameters = urllib.parse.urlencode(
        {
            "query.service_name": service,
            "query.start_time_min": _rfc3339(since),
            "query.start_time_max": _rfc3339(until),
            "query.num_traces": 1000,
            "query.raw_traces": "true",
        }
    )
    status, body = http_get(f"http://{query}/api/v3/traces?{parameters}")
    if status == 404:
        return {"resourceSpans": []}
    assert status == 200, f"Jaeger find traces: HTTP {status}: {body[:500]!r}"
    result: dict[str, Any] = json.loads(body)["result"]
    return result


def _rfc3339(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix)) + f".{int(unix % 1 * 1e6):06d}Z"


def collector_overrides(
    *, otlp_http: str, otlp_grpc: str, prometheus: str, health: str, traces_endpoint: str
) -> dict[str, Any]:
    """Merged over infra/otel/collector.yaml (maps merge key by key): only the listeners'
    addresses, where traces go (an OTLP/gRPC host:port) and the batch delay change; the
    pipelines are the shipped ones. Also how tests/cluster runs it in a pod."""
    return {
        "receivers": {
            "otlp": {
                "protocols": {
                    "http": {"endpoint": otlp_http},
                    "grpc": {"endpoint": otlp_grpc},
                }
            }
        },
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {
            "otlp_grpc/traces": {"endpoint": traces_endpoint},
            "prometheus": {"endpoint": prometheus},
        },
        "extensions": {"health_check": {"endpoint": health}},
        # Its own metrics would listen on port 8888.
        "service": {"telemetry": {"metrics": {"level": "none"}}},
    }


class Collector(Server):
    """otelcol-lapse running infra/otel/collector.yaml, with every listener moved to a free
    loopback port and traces sent to `traces_endpoint` (an OTLP/gRPC host:port)."""

    name = "otelcol"

    def __init__(self, binary: Path, work_dir: Path, traces_endpoint: str) -> None:
        super().__init__(work_dir)
        self.binary = binary
        self.otlp_http = free_port()
        self.otlp_grpc = free_port()
        self.prometheus = free_port()
        self.health = free_port()
        self.traces_endpoint = traces_endpoint
        self.overrides = work_dir / "collector-test.yaml"

    def args(self) -> list[str]:
        overrides = collector_overrides(
            otlp_http=loopback(self.otlp_http),
            otlp_grpc=loopback(self.otlp_grpc),
            prometheus=loopback(self.prometheus),
            health=loopback(self.health),
            traces_endpoint=self.traces_endpoint,
        )
        self.overrides.write_text(yaml.safe_dump(overrides))
        return [
            str(self.binary),
            f"--config={COLLECTOR_CONFIG}",
            f"--config={self.overrides}",
        ]

    def ready(self) -> bool:
        return http_get(f"http://{loopback(self.health)}/")[0] == 200


class Prometheus(Server):
    """Prometheus scraping `targets` (job name -> host:port) every second, with lapse's
    alert rules loaded."""

    name = "prometheus"

    def __init__(
        self,
        binary: Path,
        work_dir: Path,
        targets: dict[str, str],
        honor_labels: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(work_dir)
        self.binary = binary
        self.port = free_port()
        self.targets = targets
        self.honor_labels = honor_labels
        self.config = work_dir / "prometheus.yml"

    @property
    def url(self) -> str:
        return f"http://{loopback(self.port)}"

    def args(self) -> list[str]:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(alert_rules(self.work_dir))],
            "scrape_configs": [
                {
                    "job_name": job,
                    # The Collector's exporter labels series with the sender's job
                    # (service.name) and instance; keep those rather than its own.
                    "honor_labels": job in self.honor_labels,
                    "static_configs": [{"targets": [target]}],
                }
                for job, target in self.targets.items()
            ],
        }
        self.config.write_text(yaml.safe_dump(config))
        return [
            str(self.binary),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address={loopback(self.port)}",
            "--enable-feature=exemplar-storage",
        ]

    def ready(self) -> bool:
        return http_get(f"{self.url}/-/ready")[0] == 200

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: the vector (or [] when empty)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        status, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")
        answer = json.loads(body) if body else {}
        assert status == 200 and answer.get("status") == "success", (
            f"Prometheus rejected {expr!r}: HTTP {status} {answer.get('error', body[:300])}"
        )
        data = answer["data"]
        assert data["resultType"] == "vector", (expr, data["resultType"])
        result: list[dict[str, Any]] = data["result"]
        return result

    def get(self, path: str) -> Any:
        status, body = http_get(f"{self.url}{path}")
        assert status == 200, f"{path}: HTTP {status}"
        return json.loads(body)
