"""Planner throughput against a real nats-server: run.finished events planned per second.

    .venv/bin/python bench/bench_planner.py [--events 20000] [--concurrency 256]

Each run is handed over as `lapse up`'s watcher hands it (`Trust.OBSERVED`: a version lapse
read itself) and costs the planner, for the Kubernetes target (a 7-day TTL), one schedule
lookup (a direct get), one schedule publish and one audit publish, all acknowledged by
JetStream, and for the database target (no TTL without a policy) one lookup that finds
nothing to cancel. The bench checks that each new run emitted one `cleanup.scheduled` and
each unchanged re-plan nothing. The issue's target is 5,000 events/s per process (the
design's first one was 2,000).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.edges.streams import ensure_streams, stream_configs
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import RunFinished
from lapse.events.run import Engine, RunRef
from lapse.events.types import EventType
from lapse.functions.trust import Trust
from lapse.functions.ttl_planner import Planner

TARGET_PER_SECOND = 5000


def finished_event(now: datetime) -> object:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="bench", name=f"wf-{uuid.uuid4().hex[:8]}", uid=str(uuid.uuid4()),
        phase="Succeeded", finished_at=now, annotations={"lapse.dev/ttl": "7d"},
    )  # fmt: skip
    return build_event(EventType.RUN_FINISHED, source="/bench", data=RunFinished(run=run))


async def bench(events: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(Path(tmp)).start()
        try:
            nc = await connect(server.url)
            js = nc.jetstream()
            streams = Streams()
            await ensure_streams(js, stream_configs(streams))
            planner = Planner(NatsScheduleStore(js, streams), NatsEmitter(js, streams))
            now = datetime.now(UTC)
            inputs = [finished_event(now) for _ in range(events)]
            slots = asyncio.Semaphore(concurrency)

            emitted: Counter[str] = Counter()

            async def plan(event: object) -> None:
                async with slots:
                    # As `lapse up`'s watcher hands them over: versions lapse read itself.
                    # A claim (the default) would be refused here, with no API server to
                    # check it against, and this would time the refusal.
                    for out in await planner.handle(event, Trust.OBSERVED):  # type: ignore[arg-type]
                        emitted[out.get_type()] += 1

            start, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(plan(e) for e in inputs))
            first = time.perf_counter() - start
            cpu_us = (time.process_time() - cpu) / events * 1e6
            planned = {EventType.CLEANUP_SCHEDULED: events}  # the Kubernetes target's
            if emitted != planned:
                raise SystemExit(f"planner: expected {planned}, emitted {dict(emitted)}")
            emitted.clear()
            start = time.perf_counter()
            await asyncio.gather(*(plan(e) for e in inputs))  # redelivery: no-ops
            again = time.perf_counter() - start
            if emitted:
                raise SystemExit(f"planner: unchanged re-plans emitted {dict(emitted)}")
            await nc.close()
        finally:
            server.stop()
    rate, replan = events / first, events / again
    print(f"planner: {events} new runs in {first:.1f} s = {rate:,.0f} events/s "
          f"({rate / TARGET_PER_SECOND:.2f}x the {TARGET_PER_SECOND}/s target)")  # fmt: skip
    print(f"planner: {cpu_us:.0f} µs of this process's CPU per new run (nats-server apart)")
    print(f"planner: {events} unchanged re-plans in {again:.1f} s = {replan:,.0f} events/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args()
    asyncio.run(bench(args.events, args.concurrency))


if __name__ == "__main__":
    main()
