"""Soak: `lapse up` under steady load for a long time; its memory, NATS's and the streams
must stay flat, and every deletion must happen, once.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 10] [--name soak]

Runs outside `make test` (it takes as long as it is told to). A finished Workflow is
created every 1/rate s with a TTL of 10-40 s; every `--sample` seconds it records lapse's
RSS, nats-server's RSS, each stream's messages and bytes, and how many Workflows exist.
At the end it waits for the last deadlines, then checks that nothing is left (lost = 0)
and, from lapse's audit stream, that each object was deleted once. Writes
bench/out/<name>.json and prints the first and last quarter's averages: flat means the
last quarter is not above the first by more than the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.harness import LAPSE_CLI, Stack, install_argo, rss_mib, start_lapse_up

NAMESPACE = "soak"
OUT_DIR = Path(__file__).resolve().parent / "out"


def workflow(name: str, ttl: int) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true"},
            "annotations": {"lapse.dev/ttl": f"{ttl}s"},
        },
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Succeeded", "startedAt": stamp, "finishedAt": stamp},
    }


def streams(monitor_url: str) -> dict[str, dict[str, int]]:
    info = httpx.get(f"{monitor_url}/jsz", params={"streams": "true"}, timeout=10).json()
    found: dict[str, dict[str, int]] = {}
    for account in info.get("account_details", []):
        for stream in account.get("stream_detail", []):
            state = stream.get("state", {})
            found[stream["name"]] = {
                "messages": int(state.get("messages", 0)),
                "bytes": int(state.get("bytes", 0)),
            }
    return found


def quarter_means(values: list[float]) -> tuple[float, float]:
    quarter = max(1, len(values) // 4)
    return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=10.0, help="finished Workflows per second")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--name", default="soak")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lapse-soak-"))
    stack = Stack(work, users=("lapse",)).start()
    lapse: subprocess.Popen[bytes] | None = None
    try:
        admin = stack.api()
        install_argo(admin, NAMESPACE)
        lapse = start_lapse_up(
            stack, work, "safety: {max_deletions_per_second: 1000, namespaces: {include: ['*']}}\n"
        )
        config = work / "lapse.yaml"

        created: list[str] = []
        stop = threading.Event()

        def produce() -> None:
            api = stack.api()
            interval, n = 1.0 / args.rate, 0
            next_at = time.monotonic()
            while not stop.is_set():
                name = f"soak-{n:07d}"
                api.apply(api.workflows(NAMESPACE), workflow(name, 10 + n % 31))
                created.append(name)
                n += 1
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        samples: list[dict[str, Any]] = []
        end = time.monotonic() + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(args.sample)
            sample = {
                "t_s": round(args.minutes * 60 - (end - time.monotonic()), 1),
                "lapse_rss_mib": rss_mib(lapse.pid),
                "nats_rss_mib": rss_mib(stack.nats_pid),
                "workflows_present": len(admin.names(NAMESPACE, "")),
                "created": len(created),
                "streams": streams(stack.nats_monitor_url),
            }
            samples.append(sample)
            print(json.dumps(sample), flush=True)
        stop.set()
        producer.join(timeout=30)
        deadline = time.monotonic() + 120  # the last TTLs are at most 40 s
        while admin.names(NAMESPACE, "") and time.monotonic() < deadline:
            time.sleep(2)
        left = len(admin.names(NAMESPACE, ""))
        history = subprocess.run(
            [*LAPSE_CLI, "--config", str(config), "history", "-n", NAMESPACE, "-o", "json"],
            capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
        rows = json.loads(history.stdout)["items"]
        outcomes = Counter(row["outcome"] for row in rows)
        per_object = Counter(row["uid"] for row in rows if row["outcome"] == "deleted")
    finally:
        if lapse is not None and lapse.poll() is None:
            lapse.send_signal(signal.SIGINT)
            lapse.wait(timeout=60)
        stack.stop()

    lapse_rss = [s["lapse_rss_mib"] for s in samples if s["lapse_rss_mib"]]
    nats_rss = [s["nats_rss_mib"] for s in samples if s["nats_rss_mib"]]
    result = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "created": len(created),
        "left_after": left,
        "outcomes": dict(outcomes),
        "deleted_twice": sum(1 for n in per_object.values() if n > 1),
        "lapse_rss_first_last_quarter_mib": [round(v, 1) for v in quarter_means(lapse_rss)],
        "nats_rss_first_last_quarter_mib": [round(v, 1) for v in quarter_means(nats_rss)],
        "samples": samples,
    }
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(
        f"soak: {len(created):,} created over {args.minutes:g} min, {left} left, "
        f"outcomes {dict(outcomes)}, deleted twice {result['deleted_twice']}; lapse RSS "
        f"{result['lapse_rss_first_last_quarter_mib']} MiB, nats RSS "
        f"{result['nats_rss_first_last_quarter_mib']} MiB (first, last quarter)"
    )
    return 0 if left == 0 and result["deleted_twice"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
