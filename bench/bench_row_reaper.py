"""row-reaper throughput: KFP runs deleted per second through `RowReaper.handle_batch`.

    .venv/bin/python bench/bench_row_reaper.py [--runs 20000] [--batch 500] [--concurrency 2]

For each of PostgreSQL and MySQL/MariaDB (admin URLs from LAPSE_TEST_POSTGRES_URL /
LAPSE_TEST_MYSQL_URL, defaults as in tests/stack.py) it creates a scratch database with
KFP's run tables, inserts the runs (2 run_metrics, 2 tasks and 2 resource_references rows
each), builds one due event per run, and times the handler from the first event to the
last committed transaction and emitted completion: parsing, key extraction, the deletes
and building the `cleanup.completed` events. It then checks that every row is gone.
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

from cloudevents.core.base import BaseCloudEvent

from events.builder import build_event
from events.models import CleanupDue
from events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from events.types import EventType
from functions.row_reaper import RowReaper
from functions.row_reaper.targets import kfp_target
from lapse.edges.database import create_engine
from lapse.edges.rows import open_row_store
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_total
from tests.stack import scratch_database

TARGET_RATE = 5000


class CountingEmitter:
    def __init__(self) -> None:
        self.count = 0

    async def emit(self, event: BaseCloudEvent) -> None:
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


async def bench(kind: str, runs: int, batch: int, per_call: int, concurrency: int) -> float:
    async with scratch_database(kind) as db:
        engine = create_engine(db.url, pool_size=max(concurrency, 1))
        try:
            await create_kfp_tables(engine)
            run_ids = [str(uuid.uuid4()) for _ in range(runs)]
            for start in range(0, runs, 1000):
                async with engine.begin() as conn:
                    await insert_kfp_runs(conn, run_ids[start : start + 1000])
            deadline = datetime.now(UTC) - timedelta(minutes=1)
            events = [due_event(run_id, deadline) for run_id in run_ids]
            emitter = CountingEmitter()
            reaper = RowReaper(
                rows=await open_row_store(engine, [kfp_target()]),
                emitter=emitter,
                batch_size=batch,
            )
            calls = [events[i : i + per_call] for i in range(0, runs, per_call)]
            queue: asyncio.Queue[list[BaseCloudEvent]] = asyncio.Queue()
            for call in calls:
                queue.put_nowait(call)

            async def worker() -> None:
                while not queue.empty():
                    await reaper.handle_batch(queue.get_nowait())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = time.perf_counter() - started
            async with engine.connect() as conn:
                left = await kfp_total(conn)
            if any(left.values()) or emitter.count != runs:
                raise SystemExit(f"{kind}: rows left {left}, completions {emitter.count}/{runs}")
            return runs / elapsed
        finally:
            await engine.dispose()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500, help="runs per transaction")
    parser.add_argument("--per-call", type=int, default=1000, help="events per handle_batch")
    parser.add_argument("--concurrency", type=int, default=2, help="handle_batch calls at once")
    parser.add_argument("--databases", default="postgresql,mysql")
    args = parser.parse_args()
    ok = True
    for kind in args.databases.split(","):
        rate = await bench(kind, args.runs, args.batch, args.per_call, args.concurrency)
        verdict = "ok" if rate >= TARGET_RATE else f"BELOW TARGET {TARGET_RATE}"
        print(
            f"row-reaper {kind:<10} {args.runs} KFP runs (7 rows each), "
            f"batch {args.batch}, concurrency {args.concurrency}: {rate:,.0f} runs/s  {verdict}"
        )
        ok = ok and rate >= TARGET_RATE
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
