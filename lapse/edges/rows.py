"""The row-reaper's database edge: schema checks at start-up, then the deletes.

At start-up every table and column a target names is looked up in the reflected schema;
anything missing (or of a type a run's key cannot be compared with) fails at once with a
`SchemaMismatch` naming the configuration key. Statements are then built with SQLAlchemy
Core from the reflected `Table` objects: identifiers come from the reflection, values are
bound parameters, and nothing from an event is ever part of SQL text.

Deleting: one transaction per call, whatever number of runs it carries (`IN (...)` per
table). Per-run counts come from `DELETE ... RETURNING` where the dialect has it
(PostgreSQL, MariaDB, SQLite), otherwise from a locking `SELECT ... GROUP BY` before the
DELETE. A failed batch is retried run by run, so one bad run cannot hold back the others.
Database trouble is classified here, because only this module knows the drivers' errors:
`Unavailable` (retry later: unreachable, deadlock, lock timeout, shutdown) or `Rejected`
(retrying cannot help: bad data, a foreign key from an undeclared table).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import Column, MetaData, Table, delete, func, inspect, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from functions.row_reaper.ports import Counted, Rejected, RunResult, Unavailable
from functions.row_reaper.targets import ARGO_ARCHIVE, KFP, Step, TargetSpec
from lapse.config import ConfigError
from lapse.errors import LapseError

# Bound parameters per IN list: far below asyncpg's 32767 and MySQL's 65535 limits, and
# large enough that statement overhead stays small.
MAX_IN_VALUES: Final = 1000
DEFAULT_TIMEOUT: Final = 60.0
# Deadlocks between overlapping batches are retried in place this many times.
CONFLICT_RETRIES: Final = 5

# SQLSTATE classes where the same statement fails again: data exception, integrity
# violation, syntax or access rule, check option. Every other class (connection, rollback,
# resources, lock not available, shutdown, system error) may succeed later.
_PG_PERMANENT: Final = frozenset({"22", "23", "42", "44"})
# Too many connections, shutdown, lock wait timeout, deadlock, read-only (fail-over),
# interrupted, connection killed, max_execution_time, idle disconnect; 2xxx are client
# (connection) errors.
_MYSQL_TRANSIENT: Final = frozenset({1040, 1053, 1205, 1213, 1290, 1317, 1792, 1927, 3024, 4031})
# Access denied, unknown column, table/column privilege, no such table, foreign keys.
_MYSQL_PERMANENT: Final = frozenset({1044, 1045, 1054, 1142, 1143, 1146, 1451, 1452})
# Lost a race (serialization failure, deadlock, lock timeout): worth one immediate retry.
_PG_CONFLICTS: Final = frozenset({"40001", "40P01", "55P03"})
_MYSQL_CONFLICTS: Final = frozenset({1205, 1213})
_PERMANENT_CLASSES: Final = (
    sa_exc.DataError,
    sa_exc.IntegrityError,
    sa_exc.ProgrammingError,
    sa_exc.NotSupportedError,
)
_DATABASE_ERRORS: Final = (sa_exc.SQLAlchemyError, OSError, TimeoutError)


class SchemaMismatch(ConfigError):
    """The configured targets do not match the database (one line per problem)."""


class DatabaseUnavailable(LapseError):
    """The database could not be reached to check the schema."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _BadKey(Exception):
    pass


Coerce = Callable[[str], object]


@dataclass(eq=False, frozen=True)
class _Bound:
    """One step resolved against the reflected schema."""

    target: str
    name: str  # as configured: what the counts are reported under
    table: Table
    column: Column[Any]
    where: tuple[ColumnElement[bool], ...]
    coerce: Coerce
    # The parent column this child's foreign key points at, when that is not the parent's
    # key column: the child is then matched through the parent rows locked first.
    via: Column[Any] | None = None


@dataclass(eq=False, frozen=True)
class _BoundTarget:
    spec: TargetSpec
    parent: _Bound
    children: tuple[_Bound, ...]
    after: tuple[_Bound, ...]

    @property
    def steps(self) -> tuple[_Bound, ...]:
        return (*self.children, self.parent, *self.after)

    @property
    def vias(self) -> tuple[Column[Any], ...]:
        seen: dict[str, Column[Any]] = {}
        for child in self.children:
            if child.via is not None:
                seen.setdefault(child.via.name, child.via)
        return tuple(seen.values())


@dataclass
class _Run:
    index: int
    keys: Mapping[str, str]
    values: dict[_Bound, object] = field(default_factory=dict)


class SqlRowStore:
    """`functions.row_reaper.ports.RowStore` on a SQLAlchemy async engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        targets: Sequence[TargetSpec],
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.timeout = timeout
        self._targets = tuple(targets)
        self._bound: tuple[_BoundTarget, ...] | None = None
        self._starting = asyncio.Lock()

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return self._targets

    async def start(self) -> None:
        """Reflect and check the schema: `SchemaMismatch` or `DatabaseUnavailable`."""
        async with self._starting:
            if self._bound is not None:
                return
            try:
                async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
                    bound = await conn.run_sync(_reflect, self._targets)
            except _DATABASE_ERRORS as exc:
                raise DatabaseUnavailable(classify_failure(exc).reason) from exc
            self._bound = bound

    async def delete(self, runs: Sequence[Mapping[str, str]], *, dry_run: bool) -> list[RunResult]:
        try:
            await self.start()
        except DatabaseUnavailable as exc:
            return [Unavailable(exc.reason)] * len(runs)
        results: list[RunResult] = [Unavailable("not attempted")] * len(runs)
        prepared: list[_Run] = []
        for index, keys in enumerate(runs):
            run = _Run(index, keys)
            try:
                self._coerce(run)
            except _BadKey as exc:
                results[index] = Rejected(str(exc))
                continue
            prepared.append(run)
        for run, result in zip(prepared, await self._attempt(prepared, dry_run), strict=True):
            results[run.index] = result
        return results

    def _coerce(self, run: _Run) -> None:
        for target in self._bound or ():
            key = run.keys.get(target.spec.name)
            if key is None:
                continue
            for step in target.steps:
                if step.via is None:
                    try:
                        run.values[step] = step.coerce(key)
                    except ValueError as exc:
                        raise _BadKey(
                            f"{target.spec.config_key}: key {key[:200]!r} does not fit "
                            f"column {step.table.fullname}.{step.column.name} ({exc})"
                        ) from None

    async def _attempt(self, runs: list[_Run], dry_run: bool) -> list[RunResult]:
        if not runs:
            return []
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                tallies = await self._transaction(runs, dry_run)
            except _DATABASE_ERRORS as exc:
                failure = classify_failure(exc)
                # A deadlock victim is rolled back and meant to be run again; InnoDB's gap
                # locks make that likely when batches overlap, so a few quick, jittered
                # tries cost less than the runtime's redelivery.
                if attempt < CONFLICT_RETRIES and _is_conflict(exc):
                    await asyncio.sleep(random.uniform(0, 0.05 * (attempt + 1)))
                    continue
                break
            return [Counted(tuple(tally)) for tally in tallies]
        if isinstance(failure, Unavailable) or len(runs) == 1:
            return [failure] * len(runs)
        # Something in this batch is refused for good: find which run, commit the others.
        results: list[RunResult] = []
        for run in runs:
            if results and isinstance(results[-1], Unavailable):
                results.append(results[-1])
            else:
                results += await self._attempt([run], dry_run)
        return results

    async def _transaction(
        self, runs: list[_Run], dry_run: bool
    ) -> list[list[tuple[str, str, int]]]:
        tallies: list[dict[tuple[str, str], int]] = [{} for _ in runs]
        async with asyncio.timeout(self.timeout), self.engine.connect() as conn:
            normalize = _normalizer(conn)
            async with conn.begin() as tx:
                for target in self._bound or ():
                    members = [i for i, run in enumerate(runs) if target.spec.name in run.keys]
                    if members:
                        await _delete_target(
                            conn,
                            target,
                            [runs[i] for i in members],
                            [tallies[i] for i in members],
                            dry_run=dry_run,
                            normalize=normalize,
                        )
                if dry_run:
                    await tx.rollback()
        return [[(t, table, n) for (t, table), n in tally.items()] for tally in tallies]


async def open_row_store(
    engine: AsyncEngine, targets: Sequence[TargetSpec], *, timeout: float = DEFAULT_TIMEOUT
) -> SqlRowStore:
    """The row store for `targets`, its schema checked now.

    Raises `SchemaMismatch` (a configuration problem: exit, do not retry) or
    `DatabaseUnavailable` (the runtime may start anyway: every delete then retries the
    check and reports `Unavailable` until the database answers).
    """
    if not targets:
        raise SchemaMismatch(
            ["database.targets: nothing to delete (enable kfp or argo_archive, or declare tables)"]
        )
    store = SqlRowStore(engine, targets, timeout=timeout)
    await store.start()
    return store


# --- deleting ----------------------------------------------------------------------------

Normalize = Callable[[object], Hashable]


async def _delete_target(
    conn: AsyncConnection,
    target: _BoundTarget,
    runs: list[_Run],
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
        if step.via is not None:
            matched = through.get(step.via.name, {})
            owners = {key: position for key, (_, position) in matched.items()}
            values = [value for value, _ in matched.values()]
        else:
            owners, values = _owners(step, runs, normalize)
        for value, rows in await _remove(conn, step, values, dry_run=dry_run):
            position = owners.get(normalize(value))
            if position is not None:
                tallies[position][(target.spec.name, step.name)] += rows


def _owners(
    step: _Bound, runs: list[_Run], normalize: Normalize
) -> tuple[dict[Hashable, int], list[object]]:
    """Key value -> the first run that asked for it (a key asked for twice is deleted once,
    and counted for the first asker, as if the two had come one after the other)."""
    owners: dict[Hashable, int] = {}
    values: list[object] = []
    for position, run in enumerate(runs):
        value = run.values[step]
        key = normalize(value)
        if key not in owners:
            owners[key] = position
            values.append(value)
    return owners, values


async def _lock_parent(
    conn: AsyncConnection,
    target: _BoundTarget,
    runs: list[_Run],
    *,
    dry_run: bool,
    normalize: Normalize,
) -> dict[str, dict[Hashable, tuple[object, int]]]:
    parent = target.parent
    owners, values = _owners(parent, runs, normalize)
    vias = target.vias
    through: dict[str, dict[Hashable, tuple[object, int]]] = {via.name: {} for via in vias}
    for part in _slices(sorted(values, key=_sort_key)):
        query = (
            select(parent.column, *vias)
            .where(parent.column.in_(part), *parent.where)
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
    conn: AsyncConnection, step: _Bound, values: list[object], *, dry_run: bool
) -> list[tuple[object, int]]:
    """Delete (or count) the step's rows for `values`; (key value, rows) pairs."""
    counted: list[tuple[object, int]] = []
    returning = conn.dialect.delete_returning and not dry_run
    for part in _slices(values):
        condition = (step.column.in_(part), *step.where)
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


def _slices(values: list[object]) -> list[list[object]]:
    return [values[i : i + MAX_IN_VALUES] for i in range(0, len(values), MAX_IN_VALUES)]


def _sort_key(value: object) -> tuple[str, str]:
    return (type(value).__name__, str(value))


def _normalizer(conn: AsyncConnection) -> Normalize:
    """How the database compares keys, for matching returned rows to runs.

    MySQL's default collations ignore case and trailing spaces, so `WHERE k IN ('A ')`
    returns the row whose key is `a`; PostgreSQL and SQLite compare exactly.
    """
    if conn.dialect.name != "mysql":
        return _same
    return _mysql_text


def _same(value: object) -> Hashable:
    return value if isinstance(value, Hashable) else repr(value)


def _mysql_text(value: object) -> Hashable:
    return value.casefold().rstrip(" ") if isinstance(value, str) else _same(value)


# --- classifying failures ----------------------------------------------------------------


def classify_failure(exc: BaseException) -> Unavailable | Rejected:
    """Retry later, or give up on this run? Re-raises what is lapse's own bug."""
    if isinstance(exc, sa_exc.SQLAlchemyError) and not isinstance(
        exc, sa_exc.DBAPIError | sa_exc.TimeoutError | sa_exc.DisconnectionError
    ):
        raise exc  # a statement lapse built wrongly: a bug, not the database's doing
    if isinstance(exc, TimeoutError):
        return Unavailable("the database did not answer in time")
    if not isinstance(exc, sa_exc.DBAPIError):
        return Unavailable(f"database unreachable: {_one_line(exc)}")
    original = exc.orig if exc.orig is not None else exc
    # asyncpg's errors arrive re-wrapped by SQLAlchemy's adapter; the cause reads better.
    cause = original.__cause__
    reason = _one_line(cause if isinstance(cause, Exception) else original)
    if exc.connection_invalidated:
        return Unavailable(f"database connection lost: {reason}")
    sqlstate = getattr(original, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        if sqlstate[:2] in _PG_PERMANENT:
            return Rejected(f"the database refused the delete: {reason} (SQLSTATE {sqlstate})")
        if sqlstate.startswith("08"):
            return Unavailable(f"database unreachable: {reason} (SQLSTATE {sqlstate})")
        return Unavailable(f"database error, will retry: {reason} (SQLSTATE {sqlstate})")
    errno = original.args[0] if original.args and isinstance(original.args[0], int) else None
    if errno is not None and 2000 <= errno < 3000:  # the client's own: connection errors
        return Unavailable(f"database unreachable: {reason}")
    if errno in _MYSQL_TRANSIENT:
        return Unavailable(f"database error, will retry: {reason}")
    if isinstance(exc, _PERMANENT_CLASSES) or errno in _MYSQL_PERMANENT:
        return Rejected(f"the database refused the delete: {reason}")
    # Unknown: retrying is the safe side (the runtime dead-letters after its tries).
    return Unavailable(f"database error, will retry: {reason}")


def _is_conflict(exc: BaseException) -> bool:
    """Deadlock, serialization failure or lock timeout: this transaction lost a race."""
    original = exc.orig if isinstance(exc, sa_exc.DBAPIError) else None
    if original is None:
        return False
    if getattr(original, "sqlstate", None) in _PG_CONFLICTS:
        return True
    return bool(original.args) and original.args[0] in _MYSQL_CONFLICTS


def _one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."


# --- reflection ----------------------------------------------------------------------------

_MISSING_TABLE_HINTS: Final = {
    KFP: " (is database.url KFP's database, e.g. mlpipeline?)",
    ARGO_ARCHIVE: " (is database.url Argo's archive database, with persistence.archive on?)",
}


def _reflect(conn: Connection, targets: Sequence[TargetSpec]) -> tuple[_BoundTarget, ...]:
    """Resolve every step against the live schema, collecting every problem before failing."""
    reflector = _Reflector(conn)
    bound = []
    for spec in targets:
        parent = reflector.step(spec, spec.parent)
        children = tuple(reflector.step(spec, child, parent=parent) for child in spec.children)
        after = tuple(reflector.step(spec, step) for step in spec.after)
        if parent is not None and all(children) and all(after):
            bound.append(
                _BoundTarget(
                    spec,
                    parent,
                    tuple(c for c in children if c is not None),
                    tuple(a for a in after if a is not None),
                )
            )
    if reflector.problems:
        raise SchemaMismatch(list(dict.fromkeys(reflector.problems)))
    return tuple(bound)


class _Reflector:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.inspector = inspect(conn)
        self.metadata = MetaData()
        self.tables: dict[str, Table | None] = {}
        self.problems: list[str] = []
        # MySQL compares column names without regard to case; PostgreSQL quotes them.
        self.fold_case = conn.dialect.name == "mysql"

    def step(self, spec: TargetSpec, step: Step, parent: _Bound | None = None) -> _Bound | None:
        table = self._table(spec, step)
        if table is None:
            return None
        column = self._column(table, step.column, step.column_key)
        where = [self._constant(table, name, value, step.table_key) for name, value in step.where]
        if column is None or any(w is None for w in where):
            return None
        via = _referenced_parent_column(column, parent) if parent is not None else None
        # Through the parent, the values compared are the database's own: nothing to coerce.
        coerce = str if via is not None else self._coercer(column, step.column_key)
        if coerce is None:
            return None
        conditions = tuple(w for w in where if w is not None)
        return _Bound(spec.name, step.table, table, column, conditions, coerce, via)

    def _constant(
        self, table: Table, name: str, value: str, config_key: str
    ) -> ColumnElement[bool] | None:
        column = self._column(table, name, config_key)
        coerce = self._coercer(column, config_key) if column is not None else None
        if column is None or coerce is None:
            return None
        try:
            return column == coerce(value)
        except ValueError:
            self.problems.append(
                f"{config_key}: {value!r} does not fit column {column.table}.{name}"
            )
            return None

    def _table(self, spec: TargetSpec, step: Step) -> Table | None:
        if step.table not in self.tables:
            schema, _, name = step.table.rpartition(".")
            found = self.inspector.has_table(name, schema=schema or None)
            self.tables[step.table] = (
                Table(name, self.metadata, schema=schema or None, autoload_with=self.conn)
                if found
                else None
            )
        table = self.tables[step.table]
        if table is None:
            hint = _MISSING_TABLE_HINTS.get(spec.name, "")
            self.problems.append(f"{step.table_key}: table {step.table!r} does not exist{hint}")
        return table

    def _column(self, table: Table, name: str, config_key: str) -> Column[Any] | None:
        column = table.c.get(name)
        if column is not None:
            return column
        same = [c for c in table.c if c.name.lower() == name.lower()]
        if self.fold_case and len(same) == 1:
            return same[0]
        hint = f" (did you mean {same[0].name!r}?)" if same else ""
        self.problems.append(f"{config_key}: table {table.fullname!r} has no column {name!r}{hint}")
        return None

    def _coercer(self, column: Column[Any], config_key: str) -> Coerce | None:
        try:
            python_type = column.type.python_type
        except NotImplementedError:  # a type SQLAlchemy does not know: compare as text
            return str
        if python_type is str:
            return str
        if python_type is int:
            return _whole_number
        if python_type is uuid.UUID:
            return uuid.UUID
        self.problems.append(
            f"{config_key}: column {column.table.fullname}.{column.name} is {column.type}, "
            "which a run's key (text) cannot be compared with"
        )
        return None


def _referenced_parent_column(column: Column[Any], parent: _Bound) -> Column[Any] | None:
    """The parent column `column`'s single-column foreign key points at, if it is not the
    parent's key column (then the child holds e.g. the parent's surrogate id, not the key)."""
    for fk in column.foreign_keys:
        if fk.constraint is None or len(fk.constraint.elements) != 1:
            continue
        try:
            referenced = fk.column
        except sa_exc.NoReferencedTableError:  # points at a table we did not reflect
            continue
        table = referenced.table
        if table.name != parent.table.name or table.schema not in (None, parent.table.schema):
            continue
        if referenced.name == parent.column.name:
            return None
        return parent.table.c[referenced.name]
    return None


def _whole_number(value: str) -> int:
    text = value.strip()
    if not text.lstrip("+-").isdigit():
        raise ValueError("not a whole number")
    return int(text)
