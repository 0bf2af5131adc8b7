"""Memory against pending schedules: lapse's RSS and nats-server's, at 1k, 100k and 1M
deletions waiting, and the lateness of fresh deletions at each level.

    .venv/bin/python -m bench.bench_pending [--levels 1000,100000,1000000] [--name pending]

`lapse up` runs against the bench stack's kube-apiserver and nats-server. The pending
schedules are put straight into NATS through lapse's own ScheduleStore (due events for
Workflows that do not exist, 30 days out): they cost lapse and NATS exactly what a pending
deletion costs, without a million objects in etcd, which would measure etcd. At each level,
after the stream settles, it samples both processes' RSS and the schedule stream's bytes,
then creates `--probe` finished Workflows with a 3 s TTL and reads, from the API server's
audit log, when lapse deleted each: lateness at that many pending. Writes
bench/out/<name>.json. lapse holds nothing per pending schedule (the server keeps them), so
its RSS should stay flat; nats-server's bytes per schedule are what a deployment sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.compare import NAMESPACE, OUT_DIR, AuditLog, create_paced, machine
from bench.harness import Stack, install_argo, put_pending, rss_mib, start_lapse_up
from bench.report import lateness
from bench.soak import streams
from lapse.config import Streams

SETTLE_S = 10.0  # after the last put, before sampling: the server's write-behind, GC


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1000,100000,1000000")
    parser.add_argument("--probe", type=int, default=50, help="fresh deletions timed per level")
    parser.add_argument("--name", default="pending")
    args = parser.parse_args()
    levels = sorted(int(n) for n in args.levels.split(","))

    work = Path(tempfile.mkdtemp(prefix="lapse-pending-"))
    stack = Stack(work, users=("lapse",)).start()
    audit = AuditLog(stack.audit_log)
    lapse: subprocess.Popen[bytes] | None = None
    rows: list[dict[str, Any]] = []
    try:
        admin = stack.api()
        install_argo(admin, NAMESPACE)
        lapse = start_lapse_up(stack, work)
        pending = 0
        for level in levels:
            rate = asyncio.run(put_pending(stack.nats_url, level - pending))
            pending = level
            time.sleep(SETTLE_S)
            sched = streams(stack.nats_monitor_url).get(Streams().schedule, {})
            due = create_paced(admin, f"probe-{level}", "probe", args.probe, 10, 3)
            limit = max(due.values()) + 60
            while audit.deleted("lapse", set(due)) < len(due) and time.time() < limit:
                time.sleep(0.5)
            late = lateness(due, audit.read(), "lapse")
            row = {
                "pending": level,
                "put_per_s": round(rate),
                "lapse_rss_mib": rss_mib(lapse.pid),
                "nats_rss_mib": rss_mib(stack.nats_pid),
                "schedule_stream_messages": sched.get("messages"),
                "schedule_stream_bytes": sched.get("bytes"),
                "stream_bytes_per_pending": round(sched.get("bytes", 0) / max(level, 1)),
                "probe": late.as_dict(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if lapse is not None and lapse.poll() is None:
            lapse.send_signal(signal.SIGINT)
            lapse.wait(timeout=60)
        stack.stop()

    first, last = rows[0], rows[-1]
    growth = (last["lapse_rss_mib"] or 0) / max(first["lapse_rss_mib"] or 1, 1e-6) - 1
    nats_delta = (last["nats_rss_mib"] or 0) - (first["nats_rss_mib"] or 0)
    span = max(last["pending"] - first["pending"], 1)
    result = {
        "name": args.name,
        "machine": machine(),
        "levels": rows,
        "lapse_rss_growth_pct": round(growth * 100, 1),
        "lapse_memory_flat": abs(growth) <= 0.10,
        "nats_rss_bytes_per_pending": round(nats_delta * 2**20 / span),
        "nats_stream_bytes_per_pending": last["stream_bytes_per_pending"],
    }
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(
        f"pending: lapse RSS {first['lapse_rss_mib']:.0f} -> {last['lapse_rss_mib']:.0f} MiB "
        f"({result['lapse_rss_growth_pct']:+}%) from {first['pending']:,} to "
        f"{last['pending']:,}; nats-server {result['nats_rss_bytes_per_pending']} B of RSS and "
        f"{result['nats_stream_bytes_per_pending']} B on disk per pending schedule"
    )
    return 0 if all(r["probe"]["lost"] == 0 and r["probe"]["early"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
