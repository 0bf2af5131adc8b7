"""A run's own account in the database, read with its parent rows locked, before deleting.

The row-reaper's precondition (functions/row_reaper/verdict.py: `Precondition`, carried by
`RunRows.precondition`) is the locking read's own `WHERE`: the parent rows are selected
FOR UPDATE only where the key is the run's and the database says the run finished (a
finish time, a state that is not running) no later than the precondition's bound, so the
database decides which runs stand, and what it locked stays so until the transaction
ends. A run whose row the locked `WHERE` left out is read again without a lock, for what
its outcome says (`Contradicted`, judged by `verdict.judge_facts`); nothing of it is
deleted. Whose run it is (the namespace) is judged on the locked row.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    Float,
    Integer,
    Numeric,
    Row,
    and_,
    false,
    or_,
    select,
    true,
)
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from lapse.edges.rows.batch import Batch
from lapse.edges.rows.delete import Normalize, owners_of, slices
from lapse.edges.rows.model import BoundGuard, BoundTarget, PendingRun
from lapse.functions.row_reaper.verdict import Precondition, RunFacts


async def lock_and_judge(batch: Batch, target: BoundTarget) -> None:
    """A table target's account of each keyed run: the parent rows that meet their run's
    precondition locked, the others refused with what they say; a locked row of another
    namespace refuses the run too; one that names the run's namespace makes it the
    target's `owned`."""
    checks_owner = target.parent.namespace is not None
    members = [
        i for i in batch.keyed(target) if checks_owner or batch.runs[i].precondition is not None
    ]
    if (target.guard is None and not checks_owner) or not members:
        return
    runs = [batch.runs[i] for i in members]
    locked, contradicted = await read_facts(
        batch.conn, target, runs, dry_run=batch.dry_run, normalize=batch.normalize
    )
    for position, fact in contradicted.items():
        batch.refuse(members[position], fact)
    for position, fact in locked.items():
        index = members[position]
        if checks_owner and fact.namespace != batch.runs[index].namespace:
            batch.refuse(index, fact)
        elif checks_owner:
            batch.owned.setdefault(target.spec.name, set()).add(index)


async def read_facts(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    *,
    dry_run: bool,
    normalize: Normalize,
) -> tuple[dict[int, RunFacts], dict[int, RunFacts]]:
    """Per run position in `runs`: the facts of the parent rows the database locked
    (FOR UPDATE, outside a dry run) because they meet the run's precondition, and the
    facts of those it did not, read after without a lock. A run the parent table has no
    row of is in neither."""
    parent = target.parent
    owners, values = owners_of(parent, runs, normalize)
    locked: dict[int, RunFacts] = {}
    for part in slices(values):
        meeting = _meeting(target, part, runs, owners, normalize)
        query = select(*_columns(target)).where(parent.column.in_(part), *parent.where, meeting)
        query = query.order_by(parent.column)  # one lock order for every transaction
        if not dry_run:
            query = query.with_for_update()
        _collect(target, await conn.execute(query), owners, normalize, locked)
    if target.guard is None:
        return locked, {}
    others = [v for v in values if owners[normalize(v)] not in locked]
    contradicted: dict[int, RunFacts] = {}
    for part in slices(others):
        query = select(*_columns(target)).where(parent.column.in_(part), *parent.where)
        _collect(target, await conn.execute(query), owners, normalize, contradicted)
    return locked, contradicted


def _collect(
    target: BoundTarget,
    rows: Any,
    owners: dict[Hashable, int],
    normalize: Normalize,
    into: dict[int, RunFacts],
) -> None:
    for row in rows:
        position = owners.get(normalize(row[0]))
        if position is not None and position not in into:
            into[position] = _fact_of(target, row)


def _meeting(
    target: BoundTarget,
    part: list[object],
    runs: list[PendingRun],
    owners: dict[Hashable, int],
    normalize: Normalize,
) -> ColumnElement[bool]:
    """The `WHERE` that holds each key of `part` to its run's precondition, one condition
    per distinct precondition (a batch's runs share few)."""
    guard = target.guard
    if guard is None:
        return true()
    grouped: dict[Precondition | None, list[object]] = {}
    for value in part:
        grouped.setdefault(runs[owners[normalize(value)]].precondition, []).append(value)
    return or_(
        *(
            and_(target.parent.column.in_(keys), precondition_met(guard, precondition))
            for precondition, keys in grouped.items()
        )
    )


def precondition_met(guard: BoundGuard, precondition: Precondition | None) -> ColumnElement[bool]:
    """`verdict.meets` as SQL on the parent row: finished (a finish time that is not NULL,
    and not 0 where it counts seconds), not in a running state, no later than the bound.
    A finish column of a type that holds no time never meets (the row says nothing of a
    finish)."""
    if precondition is None:
        return true()
    finished = guard.finished
    kind = finished.type
    conditions: list[ColumnElement[bool]] = []
    if isinstance(kind, DateTime):
        conditions.append(finished.is_not(None))
    elif isinstance(kind, Integer | Numeric):
        conditions.append(finished > 0)
    else:
        return false()
    if guard.state is not None and guard.running_states:
        running = sorted(guard.running_states)
        conditions.append(or_(guard.state.is_(None), guard.state.not_in(running)))
    bound = precondition.finished_by
    if bound is not None:
        conditions.append(finished <= _as_column_value(kind, bound))
    return and_(*conditions)


def _as_column_value(kind: Any, bound: datetime) -> object:
    """The bound as the finish column stores times: a timestamp (naive ones read as UTC,
    as `_as_time` reads them), or seconds since the epoch (whole ones, rounded down: a
    whole-second finish is no later than the bound exactly when it is no later than its
    floor)."""
    if isinstance(kind, DateTime):
        return bound if kind.timezone else bound.astimezone(UTC).replace(tzinfo=None)
    seconds = bound.timestamp()
    if isinstance(kind, Integer):
        return math.floor(seconds)
    if isinstance(kind, Float):
        return seconds
    return Decimal(repr(seconds))


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
