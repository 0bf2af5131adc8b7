"""A run's own account in the database, read with its parent rows locked, before deleting.

The row-reaper's precondition (functions/row_reaper/verdict.py: `Precondition`, carried by
`RunRows.precondition`) is checked on this: the database's finish time and state for the
run, and whose run it is (the namespace), as the engine wrote them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Column, Row, select
from sqlalchemy.ext.asyncio import AsyncConnection

from lapse.edges.rows.batch import Batch
from lapse.edges.rows.delete import Normalize, owners_of, slices
from lapse.edges.rows.model import BoundGuard, BoundTarget, PendingRun
from lapse.functions.row_reaper.verdict import RunFacts


async def lock_and_judge(batch: Batch, target: BoundTarget) -> None:
    """A table target's account of each keyed run, its parent rows locked, judged: a row of
    another namespace (whatever the run's precondition) or a failed precondition refuses
    the run; a row that names the run's namespace makes it the target's `owned`."""
    checks_owner = target.parent.namespace is not None
    members = [
        i for i in batch.keyed(target) if checks_owner or batch.runs[i].precondition is not None
    ]
    if (target.guard is None and not checks_owner) or not members:
        return
    facts_of = await read_facts(
        batch.conn,
        target,
        [batch.runs[i] for i in members],
        dry_run=batch.dry_run,
        normalize=batch.normalize,
    )
    for position, fact in facts_of.items():
        index = members[position]
        foreign = checks_owner and fact.namespace != batch.runs[index].namespace
        stands = batch.judge(index, fact, foreign=foreign, checked=target.guard is not None)
        if stands and checks_owner:
            batch.owned.setdefault(target.spec.name, set()).add(index)


async def read_facts(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    *,
    dry_run: bool,
    normalize: Normalize,
) -> dict[int, RunFacts]:
    """Facts per run position in `runs`, for the runs the parent table has a row of: the
    guard's finish time and state, and the namespace the table records (where it records
    one). The rows are locked (FOR UPDATE, outside a dry run) until the transaction ends,
    so what is judged is what is deleted."""
    parent = target.parent
    if target.guard is None and parent.namespace is None:
        return {}
    owners, values = owners_of(parent, runs, normalize)
    facts: dict[int, RunFacts] = {}
    for part in slices(values):
        query = select(*_columns(target)).where(parent.column.in_(part), *parent.where)
        query = query.order_by(parent.column)  # one lock order for every transaction
        if not dry_run:
            query = query.with_for_update()
        for row in await conn.execute(query):
            position = owners.get(normalize(row[0]))
            if position is not None and position not in facts:
                facts[position] = _fact_of(target, row)
    return facts


def _columns(target: BoundTarget) -> list[Column[Any]]:
    """The key, the guard's finish time and state, the namespace: those the target has."""
    parent, guard = target.parent, target.guard
    columns = [parent.column]
    if guard is not None:
        columns.append(guard.finished)
        if guard.state is not None:
            columns.append(guard.state)
    if parent.namespace is not None:
        columns.append(parent.namespace)
    return columns


def _fact_of(target: BoundTarget, row: Row[Any]) -> RunFacts:
    parent, guard = target.parent, target.guard
    namespace = None
    if parent.namespace is not None:
        namespace = str(row[-1] or "") or parent.namespace_default or ""
    if guard is None:
        # Whose run it is, and nothing of its finish (the target keeps none).
        return RunFacts(running=False, finished_at=None, namespace=namespace)
    state = row[2] if guard.state is not None else None
    return _facts(guard, row[1], state, namespace)


def _facts(guard: BoundGuard, finished: Any, state: Any, namespace: str | None) -> RunFacts:
    state_text = None if state is None else str(state)
    finished_at = _as_time(finished)
    running = state_text is not None and state_text in guard.running_states
    return RunFacts(running=running, finished_at=finished_at, state=state_text, namespace=namespace)


def _as_time(value: Any) -> datetime | None:
    """A finish time as engines store it: a timestamp, or seconds since the epoch; NULL and
    0 mean "not finished"."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        return datetime.fromtimestamp(float(value), UTC) if value > 0 else None
    return None
