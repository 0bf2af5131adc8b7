"""Backlog drain: N already-expired runs (a fresh install on an old cluster), end to end.

    .venv/bin/python bench/bench_backlog.py [--count 100000] [--rate 1000]

Starts its own kube-apiserver + etcd and nats-server in a temporary directory, creates
`--count` finished Workflows whose TTL passed an hour ago, then runs lapse as users do,
as separate processes: `lapse infra apply`, `lapse reconcile` (schedules every run; the
deadlines have passed, so each fires at once) and `lapse up` (its reapers drain the due
events at `safety.max_deletions_per_second` = `--rate`). It reports:

- schedule time: reconcile's wall time and runs planned per second;
- drain time: from `lapse up` being ready until the namespace is empty, in deletions/s;
- memory: each lapse process's RSS sampled every second (flat memory: the RSS late in the
  work is no larger than early on, however many runs are still pending);
- with --verify (default): the audit trail holds exactly N `deleted` outcomes, none
  before its deadline.

Target (docs/architecture.md, "Targets"): 100,000 already-expired runs drained at the
configured rate with flat memory. 100,000 takes a while on 2 cores (creating them alone is
several minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client

from lapse.edges.kubernetes import Workflows, load_api_client
from lapse.edges.nats import connect
from lapse.embedded.kube import EmbeddedKube, argo_workflow_crd
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupCompleted
from lapse.events.types import EventType, Outcome
from lapse.operations.audit import audit_events
from tests.conftest import install_crd
from tests.stack import expired_workflow

NAMESPACE = "backlog"
SAMPLE_EVERY = 1.0
LAPSE = [sys.executable, "-m", "lapse.cli"]


# --- memory ---------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    """Resident set size of a live process, from /proc (None once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


@dataclass
class Samples:
    """(seconds since start, RSS MiB, work left) every SAMPLE_EVERY seconds."""

    points: list[tuple[float, float, int | None]] = field(default_factory=list)

    def describe(self) -> str:
        """RSS at a quarter, half, three quarters of the run and at its end, and the peak:
        flat memory means these stay level while the work left shrinks or grows."""
        if not self.points:
            return "no samples"
        rss = [p[1] for p in self.points]
        marks = [rss[min(len(rss) - 1, len(rss) * q // 4)] for q in (1, 2, 3)] + [rss[-1]]
        at = ", ".join(f"{m:.0f}" for m in marks)
        return f"RSS at 25/50/75/100% of the time {at} MiB, peak {max(rss):.0f} MiB"


async def sample_while(
    pid: int, running: Callable[[], bool], left: Callable[[], Awaitable[int | None]]
) -> Samples:
    samples = Samples()
    started = time.monotonic()
    while running():
        rss = rss_mib(pid)
        if rss is not None and rss >= 1:  # < 1 MiB: the process is still being exec'd
            samples.points.append((time.monotonic() - started, rss, await left()))
        await asyncio.sleep(SAMPLE_EVERY)
    return samples


async def _nothing() -> int | None:
    return None


# --- the cluster ----------------------------------------------------------------------------


async def create_backlog(workflows: Workflows, count: int, parallel: int) -> float:
    finished_at = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    slots = asyncio.Semaphore(parallel)
    done = 0
    started = last = time.monotonic()

    async def one(i: int) -> None:
        nonlocal done, last
        async with slots:
            await workflows.create(NAMESPACE, expired_workflow(f"old-{i:06d}", finished_at))
        done += 1
        if time.monotonic() - last > 15:
            last = time.monotonic()
            print(f"  created {done:,}/{count:,}", flush=True)

    await asyncio.gather(*(one(i) for i in range(count)))
    return time.monotonic() - started


async def remaining(workflows: Workflows) -> int:
    page = await workflows.list(NAMESPACE, limit=1)
    return len(page["items"]) + int(page["metadata"].get("remainingItemCount") or 0)


# --- lapse, as processes --------------------------------------------------------------------


def write_config(path: Path, nats_url: str, kubeconfig: Path, rate: float, count: int) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kubeconfig}'}}\n"
        "safety:\n"
        "  namespaces: {include: ['*']}\n"
        f"  max_deletions_per_second: {rate}\n"
        f"  mass_deletion_brake: {{max_due: {count * 2}}}\n"
    )
    return path


async def run_reconcile(config: Path) -> tuple[float, dict[str, Any], Samples]:
    started = time.monotonic()
    process = subprocess.Popen(  # noqa: ASYNC220 - sampled below while it runs
        [*LAPSE, "--config", str(config), "reconcile", "-n", NAMESPACE, "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
    )
    samples = await sample_while(process.pid, lambda: process.poll() is None, _nothing)
    out, _ = process.communicate()
    elapsed = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(f"lapse reconcile failed ({process.returncode})")
    summary: dict[str, Any] = json.loads(out)
    return elapsed, summary, samples


async def run_up(
    config: Path, state: Path, workflows: Workflows, count: int, stall: float
) -> tuple[float, Samples]:
    log = state / "up.log"
    with log.open("ab") as out:
        process = subprocess.Popen(  # noqa: ASYNC220 - waited for below without blocking
            [*LAPSE, "--config", str(config), "up", "--state-dir", str(state)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while "lapse is running" not in log.read_text():
            if process.poll() is not None:
                raise SystemExit(f"lapse up exited:\n{log_tail(log)}")
            await asyncio.sleep(0.2)
        started = last_line = last_progress = time.monotonic()
        left = count

        async def poll() -> int | None:
            nonlocal left, last_line, last_progress
            now, before = time.monotonic(), left
            left = await remaining(workflows)
            if left < before:
                last_progress = now
            elif now - last_progress > stall:
                raise SystemExit(
                    f"the drain stalled at {count - left:,}/{count:,} for {stall:.0f}s; "
                    f"lapse up's log:\n{log_tail(log)}"
                )
            if now - last_line > 15:
                last_line = now
                rate = (count - left) / (now - started)
                print(f"  drained {count - left:,}/{count:,} ({rate:,.0f}/s)", flush=True)
            return left

        samples = await sample_while(process.pid, lambda: left > 0, poll)
        return time.monotonic() - started, samples
    finally:
        process.send_signal(signal.SIGINT)  # in-flight work finishes, then it exits
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def log_tail(log: Path, lines: int = 40) -> str:
    """The end of a log, without the client's connection-pool chatter."""
    text = [line for line in log.read_text().splitlines() if "connectionpool" not in line]
    return "\n".join(text[-lines:])


async def verify(nats_url: str, count: int) -> str:
    """Every run deleted exactly once and none before its deadline, from the audit trail."""
    nc = await connect(nats_url)
    outcomes: Counter[str] = Counter()
    names: set[str] = set()
    early = 0
    try:
        async for event in audit_events(nc.jetstream(), "LAPSE_AUDIT"):
            if event.get_type() != EventType.CLEANUP_COMPLETED:
                continue
            try:
                done = parse_payload(event, CleanupCompleted)
            except InvalidEvent:
                continue
            outcomes[done.outcome.value] += 1
            if done.outcome is Outcome.DELETED:
                names.add(done.run.name)
                early += (done.latency_seconds or 0) < 0
    finally:
        await nc.close()
    problems = []
    if outcomes[Outcome.DELETED.value] != count or len(names) != count:
        problems.append(f"{outcomes[Outcome.DELETED.value]} deleted, {len(names)} distinct")
    if early:
        problems.append(f"{early} deleted before the deadline")
    if problems:
        raise SystemExit("verify: " + "; ".join(problems))
    return f"audit: {dict(outcomes)}; none early"


# --- main -----------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    kube = EmbeddedKube(tmp / "kube").start()
    nats = EmbeddedNats(tmp / "nats").start()
    executor = ThreadPoolExecutor(max(8, args.create_parallel), thread_name_prefix="bench")
    try:
        api = load_api_client(str(kube.kubeconfig_path))
        install_crd(api, argo_workflow_crd())
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        workflows = Workflows(api, executor)
        print(f"creating {args.count:,} expired Workflows ...", flush=True)
        created_in = await create_backlog(workflows, args.count, args.create_parallel)
        print(f"  created in {created_in:.1f}s ({args.count / created_in:,.0f}/s)", flush=True)

        config = write_config(
            tmp / "lapse.yaml", nats.url, kube.kubeconfig_path, args.rate, args.count
        )
        subprocess.run([*LAPSE, "--config", str(config), "infra", "apply"], check=True)  # noqa: ASYNC221
        print("lapse reconcile ...", flush=True)
        reconcile_in, summary, reconcile_rss = await run_reconcile(config)
        scheduled = summary["runs"]["scheduled"]
        if scheduled != args.count:
            raise SystemExit(f"reconcile scheduled {scheduled}, not {args.count}: {summary}")
        print("lapse up (draining) ...", flush=True)
        drain_in, up_rss = await run_up(
            config, tmp / "up", workflows, args.count, args.stall_timeout
        )
        audit = await verify(nats.url, args.count) if args.verify else "not verified"
        return {
            "count": args.count,
            "configuredRate": args.rate,
            "createSeconds": round(created_in, 1),
            "reconcileSeconds": round(reconcile_in, 1),
            "reconcilePlanSeconds": summary["seconds"]["runs"],
            "reconcileRunsPerSecond": round(args.count / summary["seconds"]["runs"], 1),
            "reconcileMemory": reconcile_rss.describe(),
            "drainSeconds": round(drain_in, 1),
            "deletionsPerSecond": round(args.count / drain_in, 1),
            "upMemory": up_rss.describe(),
            "upRssSamples": [(round(t, 1), round(r, 1), left) for t, r, left in up_rss.points],
            "reconcileRssSamples": [(round(t, 1), round(r, 1)) for t, r, _ in reconcile_rss.points],
            "audit": audit,
        }
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        nats.stop()
        kube.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="expired runs (default 100000)")
    parser.add_argument(
        "--rate", type=float, default=1000, help="safety.max_deletions_per_second (default 1000)"
    )
    parser.add_argument("--create-parallel", type=int, default=16)
    parser.add_argument(
        "--stall-timeout", type=float, default=180, help="give up after this long without progress"
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument("--json", type=Path, help="also write the results (with samples) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lapse-backlog-") as tmp:
        (Path(tmp) / "up").mkdir()  # lapse up's --state-dir (its SQLite file, no servers)
        result = asyncio.run(bench(args, Path(tmp)))
    print(
        f"\nbacklog {result['count']:,} expired runs, configured rate {args.rate:g}/s\n"
        f"  schedule: lapse reconcile {result['reconcileSeconds']}s wall, "
        f"{result['reconcileRunsPerSecond']:,} runs/s planned\n"
        f"            memory: {result['reconcileMemory']}\n"
        f"  drain:    {result['drainSeconds']}s, {result['deletionsPerSecond']:,} deletions/s\n"
        f"            lapse up memory: {result['upMemory']}\n"
        f"  {result['audit']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
