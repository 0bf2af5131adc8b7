"""Each function imports only what its image carries (pyproject.toml's
`[tool.lapse.function-dependencies]`, installed by the Containerfile with its closure over
requirements.lock).

A fresh interpreter, in which every installed distribution outside the function's closure
cannot be imported (as in the function's image, where it is absent), imports what a
deployed function reaches: the entry module func's glue imports, its factory (its edges),
the connections its resources open on first use, and the telemetry exporters the OTEL_*
environment can name. The built images are run for real in tests/integration/test_images.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from lapse.runtime.registry import FUNCTIONS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "images"))
from locked_requirements import normalize, requirements  # noqa: E402

# The modules a deployed function reaches beyond its factory module (lapse/runtime/factories/):
# the clients lapse.runtime.resources opens on first use, the policy follower (knative.py).
TELEMETRY = [
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.prometheus",
    "prometheus_client",
]
KUBERNETES = ["lapse.edges.kubernetes", "lapse.edges.kubernetes.reaping"]
REACHED = {
    "ttl-planner": [*KUBERNETES, "lapse.runtime.policy_watcher"],
    "object-reaper": [*KUBERNETES, "lapse.runtime.policy_watcher"],
    "row-reaper": ["lapse.edges.database", "asyncpg", "aiomysql", "aiosqlite"],
    "artifact-reaper": [*KUBERNETES],
}
# What a function must not load: another function's edge, the CLI's libraries.
NOT_LOADED = {
    "ttl-planner": ["sqlalchemy", "obstore", "rich", "argcomplete"],
    "object-reaper": ["sqlalchemy", "obstore", "rich", "argcomplete"],
    "row-reaper": ["kubernetes", "obstore", "rich", "argcomplete"],
    "artifact-reaper": ["sqlalchemy", "rich", "argcomplete"],
}

# Run in the fresh interpreter: block every module that only distributions outside the
# closure provide, then import as the image would.
PROBE = """
import importlib, json, sys
blocked = set(json.loads(sys.argv[1]))

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in this image)", name=name)
        return None

sys.meta_path.insert(0, Absent())
from lapse.runtime.registry import factory_of
for module in json.loads(sys.argv[2]):
    importlib.import_module(module)
factory_of(sys.argv[3])
for module in json.loads(sys.argv[4]):
    importlib.import_module(module)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


@functools.cache
def providers() -> dict[str, frozenset[str]]:
    """Each importable name (package or module) -> the installed distributions providing it."""
    found: dict[str, set[str]] = {}
    for distribution in importlib.metadata.distributions():
        name = normalize(distribution.metadata["Name"])
        for file in distribution.files or []:
            parts = file.parts
            if not parts or parts[0].endswith((".dist-info", ".data")) or parts[0] == "..":
                continue
            if file.name == "__init__.py":
                module = ".".join(parts[:-1])
            elif file.suffix == ".py" or file.suffix == ".so":
                module = ".".join([*parts[:-1], file.name.split(".")[0]])
            else:
                continue
            if module:
                found.setdefault(module, set()).add(name)
    return {module: frozenset(names) for module, names in found.items()}


def modules_outside(allowed: set[str]) -> set[str]:
    """The importable names that only distributions outside `allowed` provide: what is
    absent from an image installing `allowed`."""
    return {module for module, names in providers().items() if not names & allowed}


def test_each_function_imports_only_what_its_image_carries() -> None:
    # One fresh interpreter per function, all at once: each is a second or two of imports.
    probes = {}
    for function in sorted(FUNCTIONS):
        lock, pyproject = ROOT / "requirements.lock", ROOT / "pyproject.toml"
        closure = requirements(lock, pyproject, function=function)
        allowed = {package.name for package in closure} | {"lapse"}
        entry = f"lapse.functions.{function.replace('-', '_')}.function"
        probes[function] = subprocess.Popen(
            [
                sys.executable, "-c", PROBE,
                json.dumps(sorted(modules_outside(allowed))),
                json.dumps(["func_python.cloudevent", entry]),
                function,
                json.dumps([*REACHED[function], *TELEMETRY]),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
    for function, probe in probes.items():
        out, err = probe.communicate(timeout=60)
        assert probe.returncode == 0, f"{function}: {err}"
        loaded = set(json.loads(out))
        assert not loaded & set(NOT_LOADED[function]), (function, loaded)
