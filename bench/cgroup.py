"""A CPU quota per process, to simulate a machine with more cores (issue 27's scale-out).

Each `lapse up` of the scale-out phase runs in its own cgroup capped at the same share of a
core, so N of them are N equal small machines on one NATS and one API server, not N
processes fighting over 2 cores. cgroup v2 (`cpu.max`) where the unified hierarchy offers the
cpu controller, else the v1 cpu hierarchy (`cpu.cfs_quota_us`). Needs root (the benchmark
runs as root inside its network namespace).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
# Ten times the default weight: the quota caps each process, and on a machine busy with other
# work this weight lets it actually get its quota (a floor as far as the scheduler can
# give one), so N capped processes are N equal machines rather than N shares of a crowd.
WEIGHT_V2 = 1000  # cpu.weight, default 100
SHARES_V1 = 10240  # cpu.shares, default 1024


def _v2_root() -> Path | None:
    """The cgroup v2 mount that offers the cpu controller to its children, if any."""
    for root in (ROOT, ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root
    return None


def _v1_root() -> Path | None:
    root = ROOT / "cpu"
    return root if (root / "cpu.cfs_quota_us").exists() else None


def available() -> str | None:
    """Why a CPU quota cannot be set here, or None if it can."""
    if os.geteuid() != 0:
        return "not root"
    if _v2_root() is None and _v1_root() is None:
        return "no writable cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us)"
    return None


@dataclass
class CpuQuota:
    """One cgroup capped at `cores` of CPU; processes join it at exec (see `join`)."""

    name: str
    cores: float
    path: Path = Path()
    v2: bool = False

    def create(self) -> CpuQuota:
        quota = max(1000, round(self.cores * PERIOD_US))
        v2_root = _v2_root()
        if v2_root is not None:
            subtree = v2_root / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
            self.path, self.v2 = v2_root / self.name, True
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (self.path / "cpu.weight").write_text(str(WEIGHT_V2))
        else:
            v1_root = _v1_root()
            assert v1_root is not None, available()
            self.path = v1_root / self.name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            (self.path / "cpu.shares").write_text(str(SHARES_V1))
        return self

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's preexec_fn, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def throttling(self) -> dict[str, int]:
        """The kernel's counters: periods, periods throttled (cpu.stat)."""
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line
        )
        return {
            "periods": int(stat.get("nr_periods", 0)),
            "throttled": int(stat.get("nr_throttled", 0)),
        }

    def remove(self) -> None:
        """Remove the cgroup once its processes have exited (best effort)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()
