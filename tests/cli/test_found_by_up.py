"""After `lapse up` started its own NATS server (and SQLite file), every other command finds
them with no flags, through the state directory; `lapse status` says so."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli.conftest import LAPSE, Shell
from tests.conftest import KubeStack

pytestmark = [pytest.mark.kube, pytest.mark.nats]


def _wait_running(up: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise AssertionError(f"lapse up exited:\n{log.read_text()[-3000:]}")
        if "lapse is running" in log.read_text():
            return
        time.sleep(0.3)
    raise AssertionError(f"lapse up did not start:\n{log.read_text()[-3000:]}")


def test_status_right_after_up_needs_no_flags(
    shell: Shell, kube: KubeStack, tmp_path: Path
) -> None:
    env = {
        **shell.env,
        # The session's cluster holds other tests' runs: decide, delete nothing, and only
        # in namespaces that do not exist.
        "LAPSE_SAFETY__DRY_RUN": "true",
        "LAPSE_SAFETY__NAMESPACES__INCLUDE": "found-by-up-none",
    }
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [*LAPSE, "up", "--kubeconfig", str(kube.kubeconfig), "--listen", ""],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=shell.home,
        )
    try:
        _wait_running(up, log)
        url_file = shell.state_dir / "nats.url"
        assert url_file.read_text().startswith("nats://127.0.0.1:")

        status = shell("status", "-o", "json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["nats"] == {
            "url": url_file.read_text().strip(),
            "from": f"{url_file} (written by lapse up)",
        }
        db_file = shell.state_dir / "database.url"
        assert report["database"]["from"] == f"{db_file} (written by lapse up)"
        assert report["database"]["url"] == f"sqlite:///{shell.state_dir / 'lapse.db'}"
        table = shell("status")
        assert f"(from {url_file} (written by lapse up))" in table.stdout

        history = shell("history", "-o", "json")
        assert history.returncode == 0, history.stderr
        assert isinstance(json.loads(history.stdout)["items"], list)
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]
    # The server stopped with lapse up, and so did its address; the SQLite file stays.
    assert not (shell.state_dir / "nats.url").exists()
    assert (shell.state_dir / "database.url").exists()
    after = shell("status")
    assert after.returncode == 2
    assert "nats.url is not set" in after.stderr
