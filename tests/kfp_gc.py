"""KFP's own run garbage collection (main branch, kubeflow/pipelines#13532), for tests.

KFP's GC is Go code in its API server (backend/src/apiserver/gc/run_gc.go calling
storage/run_store.go). No KFP API server runs here, so its two passes are reproduced
statement by statement from `RunStore.ArchiveExpiredRuns` and
`RunStore.DeleteExpiredArchivedRuns` at that commit: the same WHERE clauses, ORDER BY,
LIMIT, FOR UPDATE locks and transaction boundaries, run against the same tables lapse
deletes from. Every `collect` tick runs the archive pass (RUNS_RETENTION_TIME), then the
delete pass (ARCHIVED_RUNS_RETENTION_TIME), each with the cutoff `now - retention`.
"""

from __future__ import annotations

import time
from typing import Final

from sqlalchemy import Select, and_, delete, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tests.kfp_schema import resource_references, run_details, run_metrics, tasks

# storage/run_store.go: terminalRunStateStrings, nonArchivedStorageStateStrings,
# archivedStorageStateStrings (model/run.go values).
TERMINAL_STATES: Final = (
    "SUCCEEDED", "FAILED", "SKIPPED", "CANCELED",
    "Succeeded", "Failed", "Skipped", "Error",
    "DONE", "DISABLED",
)  # fmt: skip
NON_ARCHIVED_STORAGE_STATES: Final = (
    "AVAILABLE", "STORAGESTATE_AVAILABLE", "STORAGE_STATE_UNSPECIFIED",
    "STORAGESTATE_UNSPECIFIED", "NO_STATUS", "Error", "ENABLED", "Ready", "",
)  # fmt: skip
ARCHIVED_STORAGE_STATES: Final = ("ARCHIVED", "STORAGESTATE_ARCHIVED", "DISABLED")

c = run_details.c


async def archive_expired_runs(engine: AsyncEngine, cutoff: int, batch_size: int) -> int:
    """RunStore.ArchiveExpiredRuns: terminal, finished before `cutoff`, not archived yet."""
    candidates = (
        select(c.UUID)
        .where(
            or_(
                c.State.in_(TERMINAL_STATES),
                and_(or_(c.State == "", c.State.is_(None)), c.Conditions.in_(TERMINAL_STATES)),
            ),
            c.FinishedAtInSec < cutoff,
            c.FinishedAtInSec > 0,
            or_(
                c.StorageState.in_(NON_ARCHIVED_STORAGE_STATES),
                c.StorageState.is_(None),
            ),
        )
        .order_by(c.FinishedAtInSec.asc())
        .limit(batch_size)
    )
    async with engine.begin() as conn:
        uuids = list((await conn.execute(candidates)).scalars())
        if not uuids:
            return 0
        result = await conn.execute(
            update(run_details)
            .values(StorageState="ARCHIVED", ArchivedAtInSec=int(time.time()))
            .where(c.UUID.in_(uuids), c.FinishedAtInSec < cutoff, c.FinishedAtInSec > 0)
        )
        return int(result.rowcount)


async def delete_expired_archived_runs(engine: AsyncEngine, cutoff: int, batch_size: int) -> int:
    """RunStore.DeleteExpiredArchivedRuns: archived before `cutoff` (or legacy rows with
    ArchivedAtInSec 0, by finish time), locked, re-verified, children first."""
    current = (
        select(c.UUID)
        .where(
            c.StorageState.in_(ARCHIVED_STORAGE_STATES),
            c.ArchivedAtInSec > 0,
            c.ArchivedAtInSec < cutoff,
            c.FinishedAtInSec < cutoff,
            c.FinishedAtInSec > 0,
        )
        .order_by(c.ArchivedAtInSec.asc())
        .limit(batch_size)
    )
    legacy = (
        select(c.UUID)
        .where(
            c.StorageState.in_(ARCHIVED_STORAGE_STATES),
            c.ArchivedAtInSec == 0,
            c.FinishedAtInSec < cutoff,
            c.FinishedAtInSec > 0,
        )
        .order_by(c.FinishedAtInSec.asc())
        .limit(batch_size)
    )
    async with engine.begin() as conn:
        uuids: list[str] = []
        for query in (legacy, current):  # legacy candidates fill the batch first
            if len(uuids) >= batch_size:
                break
            uuids += await _locked(conn, query, batch_size - len(uuids))
        if not uuids:
            return 0
        verified = list(
            (
                await conn.execute(
                    select(c.UUID).where(
                        c.UUID.in_(uuids),
                        c.StorageState.in_(ARCHIVED_STORAGE_STATES),
                        c.FinishedAtInSec < cutoff,
                        c.FinishedAtInSec > 0,
                        or_(c.ArchivedAtInSec == 0, c.ArchivedAtInSec < cutoff),
                    )
                )
            ).scalars()
        )
        if not verified:
            return 0
        await conn.execute(delete(run_metrics).where(run_metrics.c.RunUUID.in_(verified)))
        await conn.execute(delete(tasks).where(tasks.c.RunUUID.in_(verified)))
        await conn.execute(
            delete(resource_references).where(
                resource_references.c.ResourceType == "Run",
                resource_references.c.ResourceUUID.in_(verified),
            )
        )
        result = await conn.execute(delete(run_details).where(c.UUID.in_(verified)))
        return int(result.rowcount)


async def _locked(conn: AsyncConnection, query: Select[tuple[str]], room: int) -> list[str]:
    rows = await conn.execute(query.with_for_update())
    return list(rows.scalars())[:room]


async def collect(
    engine: AsyncEngine,
    *,
    runs_retention: int,
    archived_runs_retention: int,
    batch_size: int = 100,
) -> tuple[int, int]:
    """One GC tick (RunGarbageCollector.collect): (archived, deleted); a retention of 0
    turns that pass off, as in KFP."""
    now = int(time.time())
    archived = deleted = 0
    if runs_retention > 0:
        archived = await archive_expired_runs(engine, now - runs_retention, batch_size)
    if archived_runs_retention > 0:
        deleted = await delete_expired_archived_runs(
            engine, now - archived_runs_retention, batch_size
        )
    return archived, deleted
