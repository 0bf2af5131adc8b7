"""The row-reaper, built from the resources: NATS and the database, no Kubernetes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from lapse.edges.limits import ROWS
from lapse.edges.rows import CoalescingRowStore, DatabaseUnavailable, SqlRowStore, open_row_store
from lapse.functions.artifact_reaper.metadata import CaptureMetadata
from lapse.functions.ports import Handler
from lapse.functions.row_reaper import RowReaper, targets_for
from lapse.runtime.factories.common import captures, limits
from lapse.runtime.outages import Backoff
from lapse.runtime.resources import Resources

log = logging.getLogger(__name__)


async def build(resources: Resources) -> Handler | None:
    targets = targets_for(resources.config.database.targets)
    if not targets:
        return None
    timeout = resources.config.database.statement_timeout.total_seconds()
    store = await when_reachable(
        lambda: open_row_store(resources.database(), targets, timeout=timeout)
    )
    for target, schema in store.schemas.items():
        log.info("row-reaper: %s: %s", target, schema)
    # The rows' own limits, shared by every row-reaper process (lapse/edges/limits.py).
    rate_limit, brake = await limits(resources, ROWS)
    # ML Metadata's account of a KFP run's artifacts goes into the run's capture before its
    # MLMD rows are deleted: afterwards nothing says which URIs were the run's.
    artifacts = resources.config.artifacts
    metadata = (
        CaptureMetadata(await captures(resources), artifacts)
        if artifacts.stores and resources.config.database.targets.ml_metadata.enabled
        else None
    )
    return RowReaper(
        # Concurrent due events' deletes share transactions (lapse/edges/rows/coalesce.py).
        rows=CoalescingRowStore(store),
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        safety=resources.config.safety,
        rate_limit=rate_limit,
        brake=brake,
        metadata=metadata,
    )


async def when_reachable(open_store: Callable[[], Awaitable[SqlRowStore]]) -> SqlRowStore:
    """The row store, once the database answers: starting while it is down waits (not
    ready, retrying with back-off) instead of exiting, which in a pod is a crash loop."""
    backoff = Backoff(first=1.0, cap=30.0)
    attempt = 0
    while True:
        try:
            return await open_store()
        except DatabaseUnavailable as exc:
            attempt += 1
            delay = backoff.delay(attempt)
            log.warning("row-reaper: database unreachable (%s); retrying in %.0fs", exc, delay)
            await asyncio.sleep(delay)
