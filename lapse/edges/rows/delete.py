"""The deletes of one transaction: children first, one `IN (...)` per table."""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Final, TypeAlias

from sqlalchemy import delete, false, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from lapse.edges.rows.model import Bound, BoundTarget, PendingRun

# Bound parameters per IN list: far below asyncpg's 32767 and MySQL's 65535 limits, and
# large enough that statement overhead stays small.
MAX_IN_VALUES: Final = 1000


Normalize = Callable[[object], Hashable]
# Conditions beyond the key's, and the run positions they hold for.
Group: TypeAlias = tuple[tuple[ColumnElement[bool], ...], list[int]]


async def delete_target(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    tallies: list[dict[tuple[str, str], int]],
    *,
    dry_run: bool,
    normalize: Normalize,
) -> None:
    for tally in tallies:
        for step in target.steps:
            tally[(target.spec.name, step.name)] = 0
    # Matched through the locked parent rows: via column -> {value: run position}.
    through: dict[str, dict[Hashable, tuple[object, int]]] = {}
    if target.spec.locks_parent:
        through = await _lock_parent(conn, target, runs, dry_run=dry_run, normalize=normalize)
    for step in target.steps:
        groups: list[tuple[tuple[ColumnElement[bool], ...], dict[Hashable, int], list[object]]]
        if step.via is not None:
            matched = through.get(step.via.name, {})
            owners = {key: position for key, (_, position) in matched.items()}
            values = [value for value, _ in matched.values()]
            groups = [((), owners, values)]
        else:
            groups = [
                (extra, *owners_of(step, runs, normalize, positions))
                for extra, positions in namespaces(step, runs)
            ]
        for extra, owners, values in groups:
            for value, rows in await _remove(conn, step, values, extra, dry_run=dry_run):
                position = owners.get(normalize(value))
                if position is not None:
                    tallies[position][(target.spec.name, step.name)] += rows


def namespaces(step: Bound, runs: list[PendingRun]) -> list[Group]:
    """The runs grouped by the namespace the step's rows must record: one group, with no
    condition, for a step without a namespace column; a run without a namespace matches
    no row of a step with one."""
    if step.namespace is None:
        return [((), list(range(len(runs))))]
    groups: dict[str | None, list[int]] = {}
    for position, run in enumerate(runs):
        groups.setdefault(run.namespace, []).append(position)
    return [
        ((_recorded_as(step, namespace),), positions)
        for namespace, positions in sorted(groups.items(), key=lambda g: g[0] or "")
    ]


def _recorded_as(step: Bound, namespace: str | None) -> ColumnElement[bool]:
    """The step's rows recorded as `namespace`'s: its own value, or none where that stands
    for this namespace (KFP's single-user runs)."""
    column = step.namespace
    assert column is not None
    if namespace is None:
        return false()
    if namespace != step.namespace_default:
        return column == namespace
    return or_(column == namespace, column == "", column.is_(None))


def owners_of(
    step: Bound,
    runs: list[PendingRun],
    normalize: Normalize,
    positions: Sequence[int] | None = None,
) -> tuple[dict[Hashable, int], list[object]]:
    """Key value -> the first run (of `positions`, default all) that asked for it (a key
    asked for twice is deleted once, and counted for the first asker, as if the two had
    come one after the other)."""
    owners: dict[Hashable, int] = {}
    values: list[object] = []
    for position in range(len(runs)) if positions is None else positions:
        value = runs[position].values[step]
        key = normalize(value)
        if key not in owners:
            owners[key] = position
            values.append(value)
    return owners, values


async def _lock_parent(
    conn: AsyncConnection,
    target: BoundTarget,
    runs: list[PendingRun],
    *,
    dry_run: bool,
    normalize: Normalize,
) -> dict[str, dict[Hashable, tuple[object, int]]]:
    parent = target.parent
    vias = target.vias
    through: dict[str, dict[Hashable, tuple[object, int]]] = {via.name: {} for via in vias}
    for extra, positions in namespaces(parent, runs):
        owners, values = owners_of(parent, runs, normalize, positions)
        for part in slices(sorted(values, key=_sort_key)):
            query = (
                select(parent.column, *vias)
                .where(parent.column.in_(part), *parent.where, *extra)
                .order_by(parent.column)  # one lock order for every transaction
            )
            if not dry_run:
                query = query.with_for_update()
            for row in await conn.execute(query):
                position = owners.get(normalize(row[0]))
                if position is None:
                    continue
                for via, value in zip(vias, row[1:], strict=True):
                    if value is not None:
                        through[via.name].setdefault(normalize(value), (value, position))
    return through


async def _remove(
    conn: AsyncConnection,
    step: Bound,
    values: list[object],
    extra: tuple[ColumnElement[bool], ...],
    *,
    dry_run: bool,
) -> list[tuple[object, int]]:
    """Delete (or count) the step's rows for `values` that also meet `extra` (the
    namespace); (key value, rows) pairs."""
    counted: list[tuple[object, int]] = []
    returning = conn.dialect.delete_returning and not dry_run
    for part in slices(values):
        condition = (step.column.in_(part), *step.where, *extra)
        if returning:
            result = await conn.execute(delete(step.table).where(*condition).returning(step.column))
            counted += Counter(result.scalars()).items()
            continue
        query = select(step.column, func.count()).where(*condition).group_by(step.column)
        if not dry_run:
            # MySQL: counted rows stay locked, so the DELETE below removes exactly these.
            query = query.with_for_update()
        counted += ((value, int(rows)) for value, rows in await conn.execute(query))
        if not dry_run:
            await conn.execute(delete(step.table).where(*condition))
    return counted


def slices(values: list[object]) -> list[list[object]]:
    return [values[i : i + MAX_IN_VALUES] for i in range(0, len(values), MAX_IN_VALUES)]


def _sort_key(value: object) -> tuple[str, str]:
    return (type(value).__name__, str(value))


def normalizer(conn: AsyncConnection) -> Normalize:
    """How the database compares keys, for matching returned rows to runs.

    MySQL's default collations ignore case, trailing spaces and accents, so
    `WHERE k IN ('A ')` returns the row whose key is `a`, and `IN ('café')` the row `cafe`;
    PostgreSQL and SQLite compare exactly. Folding more than a collation does is harmless
    (only rows the database returned are matched); folding less would leave a returned
    row's run unjudged.
    """
    if conn.dialect.name != "mysql":
        return _same
    return _mysql_text


def _same(value: object) -> Hashable:
    return value if isinstance(value, Hashable) else repr(value)


def _mysql_text(value: object) -> Hashable:
    if not isinstance(value, str):
        return _same(value)
    plain = "".join(c for c in unicodedata.normalize("NFKD", value) if not unicodedata.combining(c))
    return plain.casefold().rstrip(" ")
