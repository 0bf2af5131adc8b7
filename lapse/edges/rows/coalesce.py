"""`CoalescingRowStore`: the row store's front that gathers concurrent deletes into one
transaction, so the row-reaper handles each due event alone and still commits a fetch's
runs together.

Group commit: a delete that finds the store idle waits one turn of the event loop (the
deletes of one fetch's events that are ready together join it), then goes; the deletes
that arrive while a transaction runs wait for it and go together in the next. No two runs
in one transaction name the same run uid or row key, in any form a database may compare
them in (functions/row_reaper/batches.py): the one of two that arrived later goes in the
next transaction, after the first committed, and its own precondition is read there with
its rows locked - as if it had been delivered after the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from lapse.functions.row_reaper.batches import row_keys, split
from lapse.functions.row_reaper.ports import RowStore, RunResult, RunRows
from lapse.functions.row_reaper.targets import TargetSpec

# The runs of one transaction at most: the dispatcher's fetch (lapse/runtime/dispatcher.py),
# the size lapse's transactions had when a fetch was one. Each holds its runs' parent rows
# locked while it deletes: bigger ones make KFP's own garbage collector (its range scans
# FOR UPDATE) the deadlock victim more often.
MAX_RUNS: Final = 64


@dataclass(frozen=True, slots=True)
class _Waiting:
    rows: RunRows
    dry_run: bool
    result: asyncio.Future[RunResult]

    def keys(self) -> frozenset[tuple[str, str]]:
        return row_keys(self.rows.uids, self.rows.keys)


class CoalescingRowStore:
    """A `RowStore` (functions/row_reaper/ports.py) whose concurrent `delete` calls share
    `inner`'s transactions: one transaction at a time, each holding what arrived while the
    one before it ran (at most `max_runs` runs)."""

    def __init__(self, inner: RowStore, *, max_runs: int = MAX_RUNS) -> None:
        self.inner = inner
        self.max_runs = max_runs
        self._waiting: list[_Waiting] = []
        self._draining: asyncio.Task[None] | None = None

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return self.inner.targets

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        loop = asyncio.get_running_loop()
        mine = [_Waiting(rows, dry_run, loop.create_future()) for rows in runs]
        self._waiting.extend(mine)
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain())
        return list(await asyncio.gather(*(w.result for w in mine)))

    async def _drain(self) -> None:
        try:
            await asyncio.sleep(0)  # the deletes ready in this turn join the first
            while self._waiting:
                await self._commit_next()
        finally:
            self._draining = None

    async def _commit_next(self) -> None:
        """One transaction: the earliest waiting runs of one kind (dry run or not) that
        share no uid or row key; the rest keep their places for the next."""
        waiting = [w for w in self._waiting if not w.result.done()]  # a caller went away
        dry_run = waiting[0].dry_run if waiting else False
        alike = [w for w in waiting if w.dry_run is dry_run]
        taken, _ = split(alike[: self.max_runs], _Waiting.keys)
        going = {id(w) for w in taken}
        self._waiting = [w for w in waiting if id(w) not in going]
        if not taken:
            return
        try:
            results = await self.inner.delete([w.rows for w in taken], dry_run=dry_run)
        except asyncio.CancelledError:
            for w in taken:
                w.result.cancel()
            raise
        except BaseException as exc:
            # A run's `record` asking to come back, or a bug: every run of this transaction
            # (nothing of it committed) gets it, as a lone call would have.
            for w in taken:
                if not w.result.done():
                    w.result.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for w, result in zip(taken, results, strict=True):
            if not w.result.done():
                w.result.set_result(result)
