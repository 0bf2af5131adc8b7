"""The row store's coalescing front (lapse/edges/rows/coalesce.py): which concurrent
deletes share a transaction, in what order, and whose result is whose.

The store behind it is in memory here (each `delete` call stands for one transaction);
the front on the real databases, through the dispatcher, is in
tests/integration/test_dispatcher_batches.py and test_row_batches_forged.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from lapse.edges.rows import CoalescingRowStore
from lapse.functions.row_reaper.ports import Counted, RunResult, RunRows
from lapse.functions.row_reaper.targets import TargetSpec, kfp_target


class Transactions:
    """Each `delete` one transaction: records its runs' KFP keys; `gate` holds it open."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], bool]] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return [kfp_target()]

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        self.calls.append(([r.keys["kfp"] for r in runs], dry_run))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            failure, self.fail = self.fail, None  # this transaction only
            raise failure
        return [Counted((("kfp", "run_details", len(r.keys["kfp"])),)) for r in runs]


def run(key: str, uid: str | None = None) -> RunRows:
    return RunRows({"kfp": key}, uids=(uid or f"uid-{key}",))


def rows_of(results: list[RunResult]) -> list[int]:
    return [r.total for r in results if isinstance(r, Counted)]


async def test_deletes_ready_together_share_one_transaction_each_with_its_own_result() -> None:
    inner = Transactions()
    store = CoalescingRowStore(inner)
    answers = await asyncio.gather(
        store.delete([run("a")], dry_run=False),
        store.delete([run("bb")], dry_run=False),
        store.delete([run("ccc")], dry_run=False),
    )
    assert inner.calls == [(["a", "bb", "ccc"], False)]
    assert [rows_of(a) for a in answers] == [[1], [2], [3]]


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (run("a", uid="other"), "the same row key"),
        (run("A ", uid="other"), "the same key as a case-insensitive collation compares it"),
        (run("b", uid="uid-a"), "the same run uid"),
    ],
)
async def test_runs_naming_the_same_rows_never_share_a_transaction(
    second: RunRows, why: str
) -> None:
    inner = Transactions()
    store = CoalescingRowStore(inner)
    await asyncio.gather(
        store.delete([run("a")], dry_run=False),
        store.delete([second], dry_run=False),
        store.delete([run("c")], dry_run=False),
    )
    # The later of the two waits for the first's transaction; the one after it does not.
    assert inner.calls == [(["a", "c"], False), ([second.keys["kfp"]], False)], why


async def test_deletes_arriving_during_a_transaction_go_together_in_the_next() -> None:
    inner = Transactions()
    inner.gate = asyncio.Event()
    store = CoalescingRowStore(inner)
    first = asyncio.ensure_future(store.delete([run("a")], dry_run=False))

    await asyncio.wait_for(inner.started.wait(), 5)
    later = [asyncio.ensure_future(store.delete([run(k)], dry_run=False)) for k in ("b", "c")]
    # Turns of the loop enough for them to arrive and, were the front not to wait, to start
    # a transaction of their own (each step is one turn: no I/O in between).
    for _ in range(10):
        await asyncio.sleep(0)
    assert inner.calls == [(["a"], False)], "nothing else starts while a transaction runs"
    inner.gate.set()
    await asyncio.gather(first, *later)
    assert inner.calls == [(["a"], False), (["b", "c"], False)]


async def test_dry_runs_and_deletes_never_share_a_transaction() -> None:
    inner = Transactions()
    store = CoalescingRowStore(inner)
    await asyncio.gather(
        store.delete([run("a")], dry_run=True),
        store.delete([run("b")], dry_run=False),
        store.delete([run("c")], dry_run=True),
    )
    assert inner.calls == [(["a", "c"], True), (["b"], False)]


async def test_what_a_transaction_raises_is_raised_to_its_runs_alone() -> None:
    inner = Transactions()
    store = CoalescingRowStore(inner)
    inner.fail = RuntimeError("a run's record refused")
    first, together, apart = await asyncio.gather(
        store.delete([run("a")], dry_run=False),
        store.delete([run("bb")], dry_run=False),
        store.delete([run("A", uid="other")], dry_run=False),  # the next transaction
        return_exceptions=True,
    )
    assert inner.calls == [(["a", "bb"], False), (["A"], False)]
    assert isinstance(first, RuntimeError) and isinstance(together, RuntimeError)
    assert not isinstance(apart, BaseException) and rows_of(apart) == [1]
    # The front goes on: the next delete has a transaction of its own.
    assert rows_of(await store.delete([run("zzz")], dry_run=False)) == [3]
