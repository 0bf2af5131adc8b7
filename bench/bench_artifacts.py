"""artifact-reaper throughput against a real S3 server (SeaweedFS, built here), beside that
server's own ceiling.

    .venv/bin/python -m bench.bench_artifacts [--runs 20] [--objects 100] [--concurrency 4]

- **Ceiling**: a plain client (obstore, no lapse) deletes `runs x objects` keys it already
  knows, in batched DeleteObjects requests of 1,000, `--concurrency` batches in flight:
  what the server can delete per second.
- **lapse**: as many objects, `--objects` under each of `--runs` runs' captured prefixes
  (a declared template), each run's capture in NATS' key-value bucket and its fired due
  message in the schedule stream (what the planner and the scheduler leave behind); the
  reaper handles the due events, `--concurrency` in flight, as the dispatcher would:
  proof from the stored schedule, capture, judgement, listing, the brake and rate limit
  (set out of the way), the deletes (each object with If-Match, 16 in flight; `--batched`:
  the store with `conditional_delete: false`, DeleteObjects of 1,000), forgetting the
  capture, the outcome event.

Printed: objects/s for both and the ratio; target (docs/architecture.md, "Targets"): lapse
at least 0.8 of the ceiling. Every object is checked gone afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import obstore
from cloudevents.core.base import BaseCloudEvent
from obstore.store import S3Store

from lapse.config import Streams
from lapse.edges import streams
from lapse.edges.artifacts import NatsCaptures, ObstoreStores
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.functions.artifact_reaper import ArtifactReaper, ArtifactsConfig, capture
from lapse.functions.safety import SafetyConfig

TARGET_RATIO = 0.8
BUCKET = "bench"
BATCH = 1000


class CountingEmitter:
    def __init__(self) -> None:
        self.count = 0

    async def emit(self, event: BaseCloudEvent) -> None:
        self.count += 1


async def plant(store: S3Store, keys: list[str], concurrency: int = 32) -> None:
    queue = list(keys)

    async def worker() -> None:
        while queue:
            await obstore.put_async(store, queue.pop(), b"x" * 512)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def count(store: S3Store, prefix: str) -> int:
    total = 0
    async for page in obstore.list(store, prefix, chunk_size=1000):
        total += len(page)
    return total


async def ceiling(store: S3Store, keys: list[str], concurrency: int) -> float:
    batches = [keys[i : i + BATCH] for i in range(0, len(keys), BATCH)]

    async def worker() -> None:
        while batches:
            await obstore.delete_async(store, batches.pop())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(keys) / (time.perf_counter() - started)


def run_of(index: int) -> RunRef:
    return RunRef(
        engine=Engine.JOB, api_version="batch/v1", kind="Job", namespace="bench",
        name=f"job-{index}", uid=str(uuid.uuid4()), phase="Succeeded",
        finished_at=datetime.now(UTC) - timedelta(hours=1),
    )  # fmt: skip


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--objects", type=int, default=100, help="objects per run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--batched",
        action="store_true",
        help="the store with conditional_delete: false (batched, no If-Match)",
    )
    args = parser.parse_args()
    total = args.runs * args.objects
    with tempfile.TemporaryDirectory() as state:
        s3 = EmbeddedSeaweedFS(Path(state) / "seaweedfs", buckets=(BUCKET,)).start()
        server = EmbeddedNats(Path(state) / "nats").start()
        nc = await nats.connect(server.url)
        try:
            os.environ.update(s3.env())
            plain = S3Store(
                BUCKET, endpoint=s3.endpoint, region=REGION, access_key_id=s3.access_key,
                secret_access_key=s3.secret_key,
                client_options={"allow_http": True, "timeout": "120s"},
            )  # fmt: skip
            keys = [f"ceiling/{i // 1000}/{i}.log" for i in range(total)]
            await plant(plain, keys)
            server_rate = await ceiling(plain, keys, args.concurrency)
            assert await count(plain, "ceiling") == 0

            js = nc.jetstream()
            await streams.ensure_streams(js, streams.stream_configs(Streams()))
            config = ArtifactsConfig.model_validate(
                {"stores": [{
                    "name": "bench", "url": f"s3://{BUCKET}/runs/", "endpoint": s3.endpoint,
                    "region": REGION, "capture": {"job": ["logs/{namespace}/{uid}/"]},
                    "conditional_delete": not args.batched,
                }]}
            )  # fmt: skip
            captures = NatsCaptures(js)
            runs = [run_of(i) for i in range(args.runs)]
            events: list[BaseCloudEvent] = []
            for run in runs:
                prefix = f"runs/logs/bench/{run.uid}/"
                await plant(plain, [f"{prefix}{i}.log" for i in range(args.objects)])
                await captures.put(capture(run, "job", None, config))
                due = CleanupDue(
                    run=run, target=Target.ARTIFACTS, deadline=run.finished_at,
                    policy="bench", scheduled_at=run.finished_at,
                )  # fmt: skip
                event = build_event(EventType.CLEANUP_DUE, source="/lapse/bench", data=due)
                message = to_nats(event)
                await js.publish(
                    due_subject(Target.ARTIFACTS, run.uid), message.body,
                    stream=Streams().schedule, headers=message.headers,
                )  # fmt: skip
                events.append(event)
            emitter = CountingEmitter()
            reaper = ArtifactReaper(
                stores=ObstoreStores(config), captures=captures,
                schedules=NatsScheduleStore(js, Streams()), emitter=emitter, config=config,
                # Measured: the deletes. Neither limit may hold them back.
                safety=SafetyConfig.model_validate(
                    {"max_deletions_per_second": 1_000_000,
                     "mass_deletion_brake": {"enabled": False}}
                ),
            )  # fmt: skip
            queue = list(events)

            async def worker() -> None:
                while queue:
                    await reaper.handle(queue.pop())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            lapse_rate = total / (time.perf_counter() - started)
            left = await count(plain, "runs")
            if left or emitter.count != args.runs:
                raise SystemExit(f"objects left {left}, outcomes {emitter.count}/{args.runs}")
        finally:
            await nc.close()
            server.stop()
            s3.stop()
    ratio = lapse_rate / server_rate
    mode = "batched" if args.batched else "each with If-Match"
    verdict = "ok" if ratio >= TARGET_RATIO else f"BELOW TARGET {TARGET_RATIO}"
    print(
        f"artifact-reaper: {total:,} objects ({args.runs} runs x {args.objects}), "
        f"{args.concurrency} in flight, {mode}: lapse {lapse_rate:,.0f} objects/s, the server's "
        f"ceiling (plain batched deletes) {server_rate:,.0f} objects/s: {ratio:.2f}  {verdict}"
    )
    return 0  # below the target is a figure printed, not a failure (`make bench` goes on)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
