"""`lapse demo` as a newcomer runs it: a subprocess on its own embedded servers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kube, pytest.mark.nats]

# Far above what a loopback scheduler needs (tens of milliseconds), far below a TTL.
LATENESS_BOUND = 2.0


def test_demo_deletes_what_it_should_and_keeps_what_it_should(tmp_path: Path) -> None:
    # The demo's temporary directory lands here, so the test can see it is cleaned up.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "lapse.cli", "demo", "--count", "8", "--no-live", "-o", "json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)

    assert summary["ok"] is True
    assert summary["problems"] == []
    # Eight runs are one of each way to expire: four plain Workflows (two with Argo's
    # ttlStrategy), two KFP runs with rows, one kept, a Tekton PipelineRun and a Job.
    assert summary["workflows"] == 8
    assert summary["kinds"] == {
        "Workflow": {"runs": 6, "deleted": 5},
        "PipelineRun": {"runs": 1, "deleted": 1},
        "Job": {"runs": 1, "deleted": 1},
    }
    assert summary["objects"] == {"expected": 7, "deleted": 7}
    assert summary["rowSets"] == {"expected": 2, "deleted": 2, "rows": 14}
    assert summary["kept"] == {"expected": 1, "present": 1}
    assert summary["failed"] == 0

    lateness = summary["latenessSeconds"]
    assert lateness["count"] == 7 + 2
    assert lateness["byTarget"]["kubernetes"]["count"] == 7
    assert lateness["byTarget"]["database"]["count"] == 2
    assert isinstance(lateness["p99"], float)
    assert 0 <= lateness["p50"] <= lateness["p99"] < LATENESS_BOUND

    assert summary["seconds"]["tour"] < 60
    assert not list(tmp_path.iterdir()), "the demo leaves nothing behind without --keep"
    # Progress went to stderr, one line per step, so stdout stayed pure JSON.
    assert re.search(r"deleted +rows +kfp-01 ", result.stderr), result.stderr
    assert re.search(r"kept +object +keep-06 ", result.stderr), result.stderr
