"""The `kfp` target on both KFP schemas — the 2.17 release's and the main branch's — and
beside KFP's own run garbage collection (main, kubeflow/pipelines#13532), on real
PostgreSQL and MariaDB.

KFP's schemas come from KFP's own models (tests/kfp_schema.py). KFP's GC is Go code in its
API server; tests/kfp_gc.py reproduces its SQL statement by statement (see there), and it
runs here concurrently with lapse's row-reaper against the same database.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.edges.rows import open_row_store
from lapse.edges.rows.failures import is_conflict
from lapse.events.types import Outcome
from lapse.functions.row_reaper.targets import kfp_target
from tests import kfp_gc
from tests import kfp_schema as kfp
from tests.integration import test_row_reaper
from tests.integration.test_row_reaper import completed, due, handle_all, reaper

pytestmark = pytest.mark.db
engine = test_row_reaper.engine  # the same fixture: a database's engine, KFP's tables dropped

# KFP's own defaults would be days; the cutoffs only have to fall on the right side of the
# rows' times (finished in 2023, archived either in 2023 or by the GC just now).
RUNS_RETENTION = 60
ARCHIVED_RUNS_RETENTION = 3600


@pytest.mark.parametrize("release", kfp.RELEASES)
async def test_each_release_is_told_apart_and_cleaned_child_first(
    engine: AsyncEngine, release: kfp.Release
) -> None:
    await kfp.create_kfp_tables(engine, release)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id], metrics=3, tasks=2)
    store = await open_row_store(engine, [kfp_target()])
    assert store.schemas == {
        "kfp": (
            "KFP main schema (run garbage collection columns present, kubeflow/pipelines#13532)"
            if release == "main"
            else "KFP 2.17 release schema (no run garbage collection columns)"
        )
    }
    handler, _ = await reaper(engine, [kfp_target()])

    result = completed((await handler.handle(due(kfp_run_id=run_id)))[0])

    assert result.outcome is Outcome.DELETED
    # The order lapse deleted in, as reported: every child table before run_details.
    assert result.detail == "kfp: run_metrics=3, tasks=2, resource_references=2, run_details=1"
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == dict.fromkeys(kfp.KFP_TABLES, 0)


async def test_lapse_and_kfps_own_gc_in_one_database(engine: AsyncEngine) -> None:
    """KFP's GC archives and deletes runs while lapse deletes the same runs on its own
    clock: a run KFP deleted first is `already_gone`, a run KFP only archived is deleted
    by lapse, and nothing is left behind or reported failed."""
    await kfp.create_kfp_tables(engine, "main")
    archived_long_ago = [str(uuid.uuid4()) for _ in range(100)]  # KFP's GC will delete these
    available = [str(uuid.uuid4()) for _ in range(100)]  # KFP's GC will only archive these
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, archived_long_ago + available)
        await conn.execute(
            update(kfp.run_details)
            .where(kfp.run_details.c.UUID.in_(archived_long_ago))
            # Archived a minute after they finished, in 2023.
            .values(StorageState="ARCHIVED", ArchivedAtInSec=1_700_000_660)
        )
    handler, _ = await reaper(engine, [kfp_target()])

    # One GC tick first, of 10 runs a pass: what it did is then certain.
    archived, deleted = await kfp_gc.collect(
        engine,
        runs_retention=RUNS_RETENTION,
        archived_runs_retention=ARCHIVED_RUNS_RETENTION,
        batch_size=10,
    )
    assert (archived, deleted) == (10, 10)
    async with engine.connect() as conn:
        states = dict(
            (await conn.execute(select(kfp.run_details.c.UUID, kfp.run_details.c.StorageState)))
            .tuples()
            .all()
        )
    gc_deleted = {r for r in archived_long_ago if r not in states}
    gc_archived = {r for r in available if states.get(r) == "ARCHIVED"}
    assert len(gc_deleted) == 10 and len(gc_archived) == 10

    # Then lapse's due events for all 200 runs, while KFP's GC keeps ticking (5 a pass).
    done = asyncio.Event()
    ticks: list[tuple[int, int]] = []

    deadlocked: list[str] = []

    async def gc_loop() -> None:
        while not done.is_set():
            try:
                ticks.append(
                    await kfp_gc.collect(
                        engine,
                        runs_retention=RUNS_RETENTION,
                        archived_runs_retention=ARCHIVED_RUNS_RETENTION,
                        batch_size=5,
                    )
                )
            except OperationalError as exc:
                # lapse's transactions lock several runs' parent rows (the row store's
                # coalescing front, as a fetch did under `lapse up`), KFP's GC a range of
                # them in its own order: InnoDB may pick KFP's transaction as a deadlock
                # victim. KFP's
                # RunGarbageCollector.collect logs a failed pass and goes on at the
                # next tick, and so does this one; lapse retries its own.
                if not is_conflict(exc):
                    raise
                deadlocked.append(str(exc.orig))

    gc = asyncio.create_task(gc_loop())
    try:
        runs = archived_long_ago + available
        emitted = await handle_all(handler, [due(kfp_run_id=r) for r in runs])
    finally:
        done.set()
        await gc
    outcomes = {
        r: completed(e) for r, e in zip(runs, emitted, strict=True)
    }  # one outcome per due event, in order
    assert len(emitted) == len(runs)

    assert ticks, "KFP's GC never ran while lapse deleted"
    for run_id in gc_deleted:
        assert outcomes[run_id].outcome is Outcome.ALREADY_GONE, outcomes[run_id]
    for run_id in gc_archived | set(available):
        # KFP's GC never deletes these within the hour: archived or not, lapse deletes them.
        assert outcomes[run_id].outcome is Outcome.DELETED, outcomes[run_id]
    tally = Counter(o.outcome for o in outcomes.values())
    assert set(tally) <= {Outcome.DELETED, Outcome.ALREADY_GONE}, tally
    # The rest of the long-archived runs raced: each was deleted by exactly one of the two.
    racing = [r for r in archived_long_ago if r not in gc_deleted]
    by_lapse = sum(outcomes[r].outcome is Outcome.DELETED for r in racing)
    by_kfp = sum(deleted for _, deleted in ticks)
    assert by_lapse + by_kfp == len(racing), (by_lapse, by_kfp, ticks)
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == dict.fromkeys(kfp.KFP_TABLES, 0)
        orphans = await conn.execute(select(func.count()).select_from(kfp.tasks))
        assert orphans.scalar_one() == 0
    print(f"lapse: {dict(tally)}; KFP GC ticks (archived, deleted) while racing: {ticks}")
