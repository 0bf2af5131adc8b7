"""row-reaper throughput on the path `lapse up` takes: the fired due messages in a real
nats-server's schedule stream, consumed by the dispatcher (`lapse.runtime.dispatcher`, its
defaults: fetches of 64, 64 in flight), which hands each fetch to `RowReaper.handle_batch`:
every event proved from its stored schedule and braked on its own, the fetch's runs deleted
in one transaction with each run held to its own record (events naming the same uid or row
key would go in later rounds, one transaction each; here every run is distinct, so a fetch
is one transaction), each outcome published to the audit stream and each message acked
after it. `--path single` times the Knative
function's path instead (one due event at a time through `RowReaper.handle`,
`--concurrency` in flight: one transaction per run).

    .venv/bin/python bench/bench_row_reaper.py [--runs 5000] [--path dispatcher|single]

For each of PostgreSQL and MySQL/MariaDB (admin URLs from LAPSE_TEST_POSTGRES_URL /
LAPSE_TEST_MYSQL_URL, defaults as in tests/stack.py) it creates a scratch database with
KFP's run tables, inserts the runs (2 run_metrics, 2 tasks and 2 resource_references rows
each), stores one fired due message per run in the schedule stream (what the scheduler
leaves behind) and times from the first event handled to the last outcome emitted
(dispatcher: and every message acked). It then checks that every row is gone.
Target (docs/architecture.md, "Targets"): at least 5,000 runs/s on each database.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tempfile

import nats
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext

from lapse.config import NatsConfig, Streams
from lapse.edges import streams
from lapse.edges.database import create_engine
from lapse.edges.publishing import NatsEmitter
from lapse.edges.rows import CoalescingRowStore, open_row_store
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.functions.row_reaper import RowReaper
from lapse.functions.row_reaper.targets import kfp_target
from lapse.functions.safety import SafetyConfig
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.routing import Route
from lapse.telemetry.handling import instrumented
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_total
from tests.stack import scratch_database

TARGET_RATE = 5000


class CountingEmitter:
    """Counts what is emitted; with `inner`, publishes it there too (the audit stream)."""

    def __init__(self, inner: NatsEmitter | None = None) -> None:
        self.count = 0
        self.inner = inner

    async def emit(self, event: BaseCloudEvent) -> None:
        if self.inner is not None:
            await self.inner.emit(event)
        self.count += 1


def due_event(run_id: str, deadline: datetime) -> BaseCloudEvent:
    run = RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="team-a",
        name=f"pipeline-{run_id[:8]}",
        uid=str(uuid.uuid4()),
        phase="Succeeded",
        labels={KFP_RUN_ID_LABEL: run_id},
        kfp_run_id=run_id,
    )
    due = CleanupDue(
        run=run, target=Target.DATABASE, deadline=deadline, policy="bench", scheduled_at=deadline
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/bench", data=due)


async def store_fired(js: JetStreamContext, events: list[BaseCloudEvent]) -> None:
    """Each due event where the scheduler leaves it when it fires."""
    for start in range(0, len(events), 500):
        acks = []
        for event in events[start : start + 500]:
            message = to_nats(event)
            data = event.get_data()
            assert isinstance(data, dict)
            subject = due_subject(Target.DATABASE, data["run"]["uid"])
            acks.append(
                js.publish(
                    subject, message.body, stream=Streams().schedule, headers=message.headers
                )
            )
        await asyncio.gather(*acks)


async def bench(kind: str, runs: int, concurrency: int, js: JetStreamContext, path: str) -> float:
    async with scratch_database(kind) as db:
        engine = create_engine(db.url, pool_size=min(concurrency, 20))
        try:
            await create_kfp_tables(engine)
            run_ids = [str(uuid.uuid4()) for _ in range(runs)]
            for start in range(0, runs, 1000):
                async with engine.begin() as conn:
                    await insert_kfp_runs(conn, run_ids[start : start + 1000])
            deadline = datetime.now(UTC) - timedelta(minutes=1)
            events = [due_event(run_id, deadline) for run_id in run_ids]
            # Only this database's runs are due: the previous one's are gone from the stream.
            await js.purge_stream(Streams().schedule)
            await store_fired(js, events)
            emitter = CountingEmitter(NatsEmitter(js, Streams()) if path == "dispatcher" else None)
            reaper = RowReaper(
                rows=CoalescingRowStore(await open_row_store(engine, [kfp_target()])),
                schedules=NatsScheduleStore(js, Streams()),
                emitter=emitter,
                # The benchmark measures the deletes: neither limit may hold them back.
                safety=SafetyConfig.model_validate(
                    {"max_deletions_per_second": 1_000_000,
                     "mass_deletion_brake": {"enabled": False}}
                ),
            )  # fmt: skip
            if path == "dispatcher":
                elapsed = await through_dispatcher(js, reaper, emitter, runs, kind)
            else:
                elapsed = await one_at_a_time(reaper, events, concurrency)
            async with engine.connect() as conn:
                left = await kfp_total(conn)
            if any(left.values()) or emitter.count != runs:
                raise SystemExit(f"{kind}: rows left {left}, completions {emitter.count}/{runs}")
            return runs / elapsed
        finally:
            await engine.dispose()


async def through_dispatcher(
    js: JetStreamContext, reaper: RowReaper, emitter: CountingEmitter, runs: int, kind: str
) -> float:
    """From the dispatcher's start to the last outcome published and every message acked."""
    route = Route(
        name=f"bench-rows-{kind}",
        function="row-reaper",
        filters={"type": EventType.CLEANUP_DUE, "target": Target.DATABASE.value},
    )
    durable = f"lapse-{route.name}"
    # Wrapped as `lapse up` wraps it (the deletion log line per run, telemetry when on).
    handler = instrumented("row-reaper", reaper)
    dispatcher = Dispatcher(js, emitter, NatsConfig(), [Subscription(route, handler)])
    started = time.perf_counter()
    running = asyncio.create_task(dispatcher.run())
    try:
        while True:
            if emitter.count >= runs:
                info = await js.consumer_info(Streams().schedule, durable)
                if info.num_ack_pending == 0 and info.num_pending == 0:
                    break
            if running.done():
                running.result()
                raise SystemExit(f"{kind}: the dispatcher stopped")
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
    finally:
        dispatcher.stop()
        await running
        await js.delete_consumer(Streams().schedule, durable)
    return elapsed


async def one_at_a_time(reaper: RowReaper, events: list[BaseCloudEvent], concurrency: int) -> float:
    queue: asyncio.Queue[BaseCloudEvent] = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)

    async def worker() -> None:
        while not queue.empty():
            await reaper.handle(queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=64, help="--path single: in flight")
    parser.add_argument(
        "--path",
        choices=["dispatcher", "single"],
        default="dispatcher",
        help="dispatcher: `lapse up`'s (a fetch a transaction); single: one run a transaction",
    )
    parser.add_argument("--databases", default="postgresql,mysql")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        server = EmbeddedNats(Path(state)).start()
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await streams.ensure_streams(js, streams.stream_configs(Streams()))
            for kind in args.databases.split(","):
                rate = await bench(kind, args.runs, args.concurrency, js, args.path)
                verdict = "ok" if rate >= TARGET_RATE else f"BELOW TARGET {TARGET_RATE}"
                how = (
                    "through the dispatcher, a fetch (64) a transaction"
                    if args.path == "dispatcher"
                    else f"one transaction each, {args.concurrency} in flight"
                )
                print(
                    f"row-reaper {kind:<10} {args.runs} KFP runs (7 rows each), {how}: "
                    f"{rate:,.0f} runs/s  {verdict}"
                )
        finally:
            await nc.close()
            server.stop()
    # A figure below the target is printed, not a failure: `make bench` goes on to the
    # next benchmark (benchmarks are not tests).
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
