"""The deletion limits hold for the deployment, not per process: several processes share
the rate limit and the mass-deletion brake through NATS (lapse/edges/limits.py), against a
real nats-server. Per-process limits (functions/ratelimit.py) would let N processes delete
at N times the rate and trip the brake N times."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lapse.config import LapseConfig
from lapse.edges.limits import NatsBrake, NatsRateLimit
from lapse.embedded.nats import EmbeddedNats
from lapse.functions.object_reaper import ObjectReaper
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from lapse.telemetry import InstrumentedHandler
from tests.conftest import KubeStack

pytestmark = [pytest.mark.nats]

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4
LAPSE = Path(sys.executable).with_name("lapse")


async def workers(
    url: str, mode: str, count: int, *, rate: float = 1, max_due: int = 1, window: float = 60
) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "tests.limits_worker", url, mode, str(count), str(rate),
            str(max_due), str(window)]  # fmt: skip
    procs = [
        await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(PROCESSES)
    ]
    results = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    return results


async def test_four_processes_together_delete_at_the_configured_rate(
    own_nats: EmbeddedNats,
) -> None:
    rate, each = 20.0, 30  # 120 deletions at 20/s: 6 s for the deployment (1.5 s per process)
    results = await workers(own_nats.url, "rate", each, rate=rate)
    used = sorted(t for r in results for t in r["used"])
    assert len(used) == PROCESSES * each
    span = used[-1] - used[0]
    # Slots are whole seconds of the clock, the first one partly gone: 120 at 20/s span at
    # least 4 s. Per-process limits (4 x 20/s) would be done in about 1.5 s.
    assert span >= len(used) / rate - 2, span
    # No second of the run holds more than the rate (a little slack for sleep wake-ups).
    per_second = Counter(int(t) for t in used)
    assert max(per_second.values()) <= rate + 2, per_second
    # Every process got its share: nobody was starved.
    assert all(len(r["used"]) == each for r in results)


async def test_the_brake_trips_once_for_the_deployment_and_a_command_releases_it(
    own_nats: EmbeddedNats,
) -> None:
    max_due = 30
    results = await workers(own_nats.url, "brake", 20, max_due=max_due, window=60)
    decisions = [d for r in results for d in r["decisions"]]
    admitted = [d for d in decisions if d["admitted"]]
    tripped = [d for d in decisions if d["tripped"]]
    assert len(admitted) == max_due  # 80 asked, 30 within the window for the deployment
    assert len(tripped) == 1  # one alert, not one per process
    refused_until = {round(d["until"], 3) for d in decisions if not d["admitted"]}
    assert refused_until == {round(tripped[0]["until"], 3)}  # one pause for everyone

    env = {**os.environ, "LAPSE_NATS__URL": own_nats.url}

    async def lapse(*args: str) -> str:
        out = await asyncio.to_thread(
            subprocess.run, [str(LAPSE), *args], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert (await lapse("brake", "status")).startswith("kubernetes: engaged since")
    assert (await lapse("brake", "status", "--target", "database")).strip() == "not engaged"
    assert (await lapse("brake", "release", "--target", "kubernetes")).startswith("released")
    assert (await lapse("brake", "status")).splitlines() == [
        "kubernetes: not engaged",
        "database: not engaged",
        "artifacts: not engaged",
    ]
    again = await workers(own_nats.url, "brake", 1, max_due=max_due, window=60)
    assert all(d["admitted"] for r in again for d in r["decisions"])
    # Engaged by hand (that the reapers then pause: tests/e2e/test_fleet.py, from the hub).
    said = await lapse("brake", "engage", "--target", "kubernetes", "--for", "5m")
    assert said.startswith("engaged until"), said
    assert (await lapse("brake", "status")).startswith("kubernetes: engaged since")


@pytest.mark.kube
async def test_every_reaper_lapse_builds_uses_the_shared_limits(
    own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    """`lapse up` and the object-reaper function get their reaper from the registry: two of
    them (two processes' worth) share one brake."""
    config = LapseConfig.model_validate(
        {
            "nats": {"url": own_nats.url},
            "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
            "safety": {"mass_deletion_brake": {"max_due": 1, "window": "1m"}},
        }
    )
    async with Resources(config) as one, Resources(config) as two:
        reapers = []
        for resources in (one, two):
            handler = await build_handler("object-reaper", resources)
            assert isinstance(handler, InstrumentedHandler)
            reaper = handler.inner
            assert isinstance(reaper, ObjectReaper)
            assert isinstance(reaper.rate_limit, NatsRateLimit)
            assert isinstance(reaper.brake, NatsBrake)
            reapers.append(reaper)
        first = await reapers[0].brake.admit(time.time())  # type: ignore[union-attr]
        second = await reapers[1].brake.admit(time.time())  # type: ignore[union-attr]
    assert first.admitted and not second.admitted and second.tripped
