"""The configured targets resolved against the reflected schema, and a run on its way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Column, Table
from sqlalchemy.sql.elements import ColumnElement

from lapse.edges.rows.mlmd import MlmdTables
from lapse.functions.row_reaper.mlmd import ArtifactAccount
from lapse.functions.row_reaper.targets import TargetSpec
from lapse.functions.row_reaper.verdict import Precondition


class BadKey(Exception):
    pass


Coerce = Callable[[str], object]


@dataclass(eq=False, frozen=True)
class Bound:
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
    # Where the table records the run's namespace (the step's `namespace_column`): every
    # statement on the step holds its rows to the run's namespace.
    namespace: Column[Any] | None = None
    # The namespace a NULL or empty `namespace` value stands for (Step.namespace_default).
    namespace_default: str | None = None


@dataclass(eq=False, frozen=True)
class BoundGuard:
    """A target's `Guard` resolved against the parent table (functions/row_reaper/targets.py)."""

    finished: Column[Any]
    state: Column[Any] | None
    running_states: frozenset[str]


@dataclass(eq=False, frozen=True)
class BoundTarget:
    spec: TargetSpec
    parent: Bound
    children: tuple[Bound, ...]
    after: tuple[Bound, ...]
    guard: BoundGuard | None = None
    # What the database turned out to be, where lapse tells versions apart (KFP's schema).
    schema: str | None = None
    # ML Metadata's tables, for a target whose rows are MLMD's graph (spec.graph "mlmd").
    mlmd: MlmdTables | None = None

    @property
    def steps(self) -> tuple[Bound, ...]:
        return (*self.children, self.parent, *self.after)

    @property
    def vias(self) -> tuple[Column[Any], ...]:
        seen: dict[str, Column[Any]] = {}
        for child in self.children:
            if child.via is not None:
                seen.setdefault(child.via.name, child.via)
        return tuple(seen.values())


@dataclass
class PendingRun:
    index: int
    keys: Mapping[str, str]
    precondition: Precondition | None = None
    values: dict[Bound, object] = field(default_factory=dict)
    record: Callable[[ArtifactAccount], Awaitable[None]] | None = None
    namespace: str | None = None
