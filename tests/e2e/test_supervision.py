"""What ends `lapse up` (a subprocess, on a real kube-apiserver with the policy CRDs
installed, and a real NATS): only what retrying cannot change, a configuration error, or a
signal. Every transient fault is waited out under one supervisor and shown: that is the
fault matrix's (tests/e2e/test_fault_matrix.py: the API server, NATS, each database and
the S3 store refused, then black-holed, for 60 s, through one `lapse up` with every
component on, and a second one started in the outage that waits instead of exiting).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from lapse.embedded.nats import EmbeddedNats
from tests.conftest import KubeStack
from tests.e2e.test_engines import config_file
from tests.e2e.test_lapse_up import LapseUp

pytestmark = [pytest.mark.kube, pytest.mark.nats]


def spawn(up: LapseUp) -> None:
    """Start `up` without waiting for it to run (it cannot while the API server is away)."""
    with up.log.open("ab") as out:
        up.process = subprocess.Popen(up.args, stdout=out, stderr=subprocess.STDOUT)


async def test_what_retrying_cannot_change_ends_lapse_up_saying_why(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    """Credentials the API server refuses (401) are not an outage: retried, they would be
    refused forever while the process looked alive. It exits, naming the answer."""
    kubeconfig = tmp_path / "refused.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kube.server.kubeconfig(token="not-a-valid-token")))
    refused = dataclasses.replace(kube, kubeconfig=kubeconfig)
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, refused)
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    spawn(up)
    assert up.process is not None
    try:
        code = await asyncio.to_thread(up.process.wait, 60)
    finally:
        up.stop(signal.SIGKILL)
    log = up.log.read_text()
    assert code == 1, log[-3000:]
    assert "API server refused lapse (answered 401" in log, log[-3000:]
    assert "lapse stops (retrying cannot change it)" in log, log[-3000:]
    assert "lapse is running" not in log
