"""A release of this tree (`make release`, scripts/release.py) for the tests: built into a
directory from the images `make images` cached, and pushed to a registry as docs/releasing.md
says (`--push REGISTRY --insecure`: the test registries speak plain HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from tests.helm_chart import helm

ROOT = Path(__file__).resolve().parents[1]
RELEASE_SCRIPT = ROOT / "scripts" / "release.py"
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def build_release(out: Path) -> Path:
    """scripts/release.py --out OUT: every artifact of VERSION in `out` (returned)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(RELEASE_SCRIPT), "--out", str(out), "--helm", str(helm())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"release: {time.monotonic() - started:.1f} s")
    return out


def push_release(out: Path, registry: str) -> None:
    """scripts/release.py --push REGISTRY --insecure: the images to REGISTRY/lapse/<name>
    (digests kept) and the chart to oci://REGISTRY/charts/lapse."""
    done = subprocess.run(
        [sys.executable, str(RELEASE_SCRIPT), "--out", str(out), "--helm", str(helm()),
         "--push", registry, "--insecure"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


def release_manifest(out: Path) -> dict[str, Any]:
    """release.json of the release in `out`."""
    data: dict[str, Any] = json.loads((out / "release.json").read_text())
    return data
