"""Start-up: every table and column a target names, looked up in the reflected schema."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Column, MetaData, Table, inspect, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from lapse.config import ConfigError
from lapse.edges.rows.mlmd import COLUMNS as MLMD_COLUMNS
from lapse.edges.rows.mlmd import MlmdTables
from lapse.edges.rows.model import Bound, BoundGuard, BoundTarget, Coerce
from lapse.functions.row_reaper.targets import (
    ARGO_ARCHIVE,
    KFP,
    ML_METADATA,
    TEKTON_RESULTS,
    Step,
    TargetSpec,
    kfp_schema,
)


class SchemaMismatch(ConfigError):
    """The configured targets do not match the database (one line per problem)."""


_BUILT_IN: Final = frozenset({KFP, ARGO_ARCHIVE, ML_METADATA, TEKTON_RESULTS})
_MISSING_TABLE_HINTS: Final = {
    TEKTON_RESULTS: " (is database.url Tekton Results' database?)",
    ML_METADATA: " (is database.targets.ml_metadata.database MLMD's database, e.g. metadb?)",
    KFP: " (is database.url KFP's database, e.g. mlpipeline?)",
    ARGO_ARCHIVE: " (is database.url Argo's archive database, with persistence.archive on?)",
}


def reflect_targets(conn: Connection, targets: Sequence[TargetSpec]) -> tuple[BoundTarget, ...]:
    """Resolve every step against the live schema, collecting every problem before failing."""
    reflector = _Reflector(conn)
    bound = []
    for spec in targets:
        parent = reflector.step(spec, spec.parent)
        children = tuple(reflector.step(spec, child, parent=parent) for child in spec.children)
        after = tuple(reflector.step(spec, step) for step in spec.after)
        guard = reflector.guard(spec, parent) if parent is not None else None
        mlmd = reflector.mlmd(spec) if spec.graph == "mlmd" else None
        if spec.graph == "mlmd" and mlmd is None:
            continue
        if parent is not None and all(children) and all(after):
            bound.append(
                BoundTarget(
                    spec,
                    parent,
                    tuple(c for c in children if c is not None),
                    tuple(a for a in after if a is not None),
                    guard,
                    reflector.schema(spec, parent),
                    mlmd,
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

    def step(self, spec: TargetSpec, step: Step, parent: Bound | None = None) -> Bound | None:
        table = self._table(spec, step)
        if table is None:
            return None
        column = self._column(table, step.column, step.column_key)
        where = [self._constant(table, name, value, step.table_key) for name, value in step.where]
        fits, namespace = self._namespace(spec, table, step)
        if column is None or any(w is None for w in where) or not fits:
            return None
        via = _referenced_parent_column(column, parent) if parent is not None else None
        # Through the parent, the values compared are the database's own: nothing to coerce.
        coerce = str if via is not None else self._coercer(column, step.column_key)
        if coerce is None:
            return None
        conditions = tuple(w for w in where if w is not None)
        return Bound(
            spec.name,
            step.table,
            table,
            column,
            conditions,
            coerce,
            via,
            namespace,
            step.namespace_default,
        )

    def _namespace(
        self, spec: TargetSpec, table: Table, step: Step
    ) -> tuple[bool, Column[Any] | None]:
        """The step's namespace column (None: it has none), and False when it is missing or
        cannot hold a namespace (the problem is noted)."""
        if step.namespace_column is None:
            return True, None
        key = (
            f"{spec.config_key}.namespace_column" if spec.name not in _BUILT_IN else step.column_key
        )
        column = self._column(table, step.namespace_column, key)
        if column is None:
            return False, None
        if self._coercer(column, key) is not str:
            self.problems.append(
                f"{key}: column {table.fullname}.{column.name} is {column.type}, not text: "
                "it cannot hold a namespace"
            )
            return False, None
        return True, column

    def mlmd(self, spec: TargetSpec) -> MlmdTables | None:
        """Every ML Metadata table and column lapse reads or deletes by, beside the context
        table (the target's parent), in the same database."""
        prefix = spec.parent.table.rpartition(".")[0]
        tables: dict[str, Table] = {}
        for name, columns in MLMD_COLUMNS.items():
            step = Step(
                f"{prefix}.{name}" if prefix else name, "", spec.config_key, spec.config_key
            )
            table = self._table(spec, step)
            if table is None:
                continue
            if all(self._column(table, column, spec.config_key) is not None for column in columns):
                tables[name] = table
        return MlmdTables(tables) if len(tables) == len(MLMD_COLUMNS) else None

    def schema(self, spec: TargetSpec, parent: Bound) -> str | None:
        """KFP's schema generation (2.17 or main), told from run_details' columns; ML
        Metadata's schema version (its MLMDEnv table)."""
        if spec.graph == "mlmd":
            prefix = spec.parent.table.rpartition(".")[0]
            env = self._table(
                spec,
                Step(
                    f"{prefix}.MLMDEnv" if prefix else "MLMDEnv",
                    "",
                    spec.config_key,
                    spec.config_key,
                ),
            )
            if env is None or self._column(env, "schema_version", spec.config_key) is None:
                return None
            version = self.conn.execute(select(env.c.schema_version)).scalar()
            return f"ML Metadata schema version {version}"
        if spec.name != KFP:
            return None
        return kfp_schema([c.name for c in parent.table.c], fold_case=self.fold_case)

    def guard(self, spec: TargetSpec, parent: Bound) -> BoundGuard | None:
        """The parent table's own account of the run, where the target has one."""
        guard = spec.guard
        if guard is None:
            return None
        key = (
            f"{spec.config_key}.finished_column" if spec.name not in _BUILT_IN else spec.config_key
        )
        columns: dict[str, Column[Any] | None] = {}
        for name in filter(None, (guard.finished_column, guard.state_column)):
            if name in guard.optional and not self._has_column(parent.table, name):
                columns[name] = None
            else:
                columns[name] = self._column(parent.table, name, key)
        finished = columns.get(guard.finished_column)
        if finished is None:
            return None
        state = columns.get(guard.state_column) if guard.state_column else None
        return BoundGuard(finished, state, guard.running_states)

    def _has_column(self, table: Table, name: str) -> bool:
        if table.c.get(name) is not None:
            return True
        return self.fold_case and any(c.name.lower() == name.lower() for c in table.c)

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


def _beside(spec: TargetSpec, table: str) -> Step:
    """A table in the same schema as the target's parent table (ML Metadata's others)."""
    schema = spec.parent.table.rpartition(".")[0]
    return Step(f"{schema}.{table}" if schema else table, "", spec.config_key, spec.config_key)


def _referenced_parent_column(column: Column[Any], parent: Bound) -> Column[Any] | None:
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
