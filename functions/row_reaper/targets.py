"""What the row-reaper deletes: each database target's tables, in order, and the run's key.

Pure data and pure functions. The database edge (`lapse.edges.rows`) checks every name here
against the reflected schema at start-up and turns the steps into statements; nothing here
knows SQL. Table and column names come only from configuration or from the engines' own
schemas (KFP, Argo); an event contributes key values, never names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from lapse.events.run import KFP_RUN_ID_LABEL, RunRef
from lapse.functions.errors import FunctionError

KeyKind = Literal["uid", "name", "label", "annotation", "kfp_run_id"]

KFP: Final = "kfp"
ARGO_ARCHIVE: Final = "argo_archive"
ML_METADATA: Final = "ml_metadata"
TEKTON_RESULTS: Final = "tekton_results"
# Argo's offloaded node status table; Argo's default name, which lapse's configuration
# does not (yet) let anyone change.
ARGO_OFFLOAD_TABLE: Final = "argo_workflows"
# Where each engine records whose run a row is (gorm's and Argo's column names).
KFP_NAMESPACE_COLUMN: Final = "Namespace"
# KFP in single-user mode leaves run_details.Namespace empty: its runs are those of the
# namespace KFP is installed in (`database.targets.kfp.single_user_namespace`).
KFP_SINGLE_USER_NAMESPACE: Final = "kubeflow"
ARGO_NAMESPACE_COLUMN: Final = "namespace"
KFP_RUN_RESOURCE_TYPE: Final = "Run"
# KFP v2's RuntimeState values of a run that is not over (backend/api/v2beta1/run.proto).
KFP_RUNNING_STATES: Final = frozenset(
    {"PENDING", "RUNNING", "CANCELING", "PAUSED", "RUNTIME_STATE_UNSPECIFIED"}
)


# The run_details columns kubeflow/pipelines#13532 (database garbage collection, main branch
# after 2.17) added; 2.17's model (backend/src/apiserver/model/run.go) has none of them.
KFP_RUN_GC_COLUMNS: Final = ("ArchivedAtInSec", "RetryGeneration", "RetryClaimedAtInSec")


def kfp_schema(run_details_columns: Sequence[str], *, fold_case: bool = False) -> str:
    """Which KFP schema the database has, from run_details' columns, for the start-up line.

    lapse deletes the same tables in the same order on both: the GC columns change only
    how KFP itself expires runs (docs/architecture.md, "KFP's own garbage collection")."""
    fold = str.lower if fold_case else str
    present = {fold(c) for c in run_details_columns}
    found = [c for c in KFP_RUN_GC_COLUMNS if fold(c) in present]
    if len(found) == len(KFP_RUN_GC_COLUMNS):
        return "KFP main schema (run garbage collection columns present, kubeflow/pipelines#13532)"
    if not found:
        return "KFP 2.17 release schema (no run garbage collection columns)"
    return f"KFP schema with only some run garbage collection columns ({', '.join(found)})"


class MissingKey(FunctionError):
    """The run carries nothing to find this target's rows by (e.g. no such label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class KeySource:
    """Where a target's key comes from on the run."""

    kind: KeyKind
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> KeySource:
        """`uid`, `name`, `label:<key>` or `annotation:<key>` (the configuration's syntax)."""
        kind, sep, name = text.partition(":")
        if not sep and kind in ("uid", "name"):
            return cls("uid" if kind == "uid" else "name")
        if sep and name and kind in ("label", "annotation"):
            return cls("label" if kind == "label" else "annotation", name)
        raise ValueError(
            f"{text!r} is not a key source (use uid, name, label:<key> or annotation:<key>)"
        )

    def describe(self) -> str:
        if self.kind == "kfp_run_id":
            return f"the KFP run id (label {KFP_RUN_ID_LABEL})"
        if self.kind in ("label", "annotation"):
            return f"{self.kind} {self.name!r}"
        return f"the run's {self.kind}"

    def of(self, run: RunRef) -> str:
        """The key value for `run`; `MissingKey` if the run has none (or an empty one)."""
        value: str | None
        if self.kind == "uid":
            value = run.uid
        elif self.kind == "name":
            value = run.name
        elif self.kind == "kfp_run_id":
            # Adapters copy the label into kfp_run_id; a hand-made RunRef may carry only one.
            value = run.kfp_run_id or run.labels.get(KFP_RUN_ID_LABEL)
        elif self.kind == "label":
            value = run.labels.get(self.name or "")
        else:
            value = run.annotations.get(self.name or "")
        if value is None:
            raise MissingKey(f"{self.describe()} is not set on {run.subject}")
        if not value.strip():
            raise MissingKey(f"{self.describe()} is empty on {run.subject}")
        return value


@dataclass(frozen=True)
class Step:
    """Delete (or lock) the rows of `table` whose `column` equals the run's key.

    `where` adds equalities with constants (the engine's own discriminators, such as KFP's
    `ResourceType = 'Run'` or Argo's cluster name). `namespace_column`, when set, is where
    the table records the run's namespace: only rows whose value there is the namespace
    lapse stored with the run (from the API server's object) are locked and deleted, and on
    the parent table a row of another namespace refuses the run (the key may be a label, a
    tenant's word: docs/security.md, "Tenants and databases"). `table_key` / `column_key`
    name the configuration keys the names came from, so a start-up error can point at them.
    """

    table: str
    column: str
    table_key: str
    column_key: str
    where: tuple[tuple[str, str], ...] = ()
    namespace_column: str | None = None
    # The namespace a NULL or empty value in `namespace_column` stands for (KFP's
    # single-user runs); None: such a row is no namespace's, and refuses every run.
    namespace_default: str | None = None


@dataclass(frozen=True)
class Guard:
    """Where the parent table keeps its own account of the run, read (with the parent rows
    locked) before anything is deleted: the finish time (`finished_column`: a timestamp, or
    seconds since the epoch; NULL or 0 while the run goes on) and, optionally, a state
    (`state_column`, running while it is one of `running_states`). A column the database
    does not have is not read (`optional`: an older schema)."""

    finished_column: str
    state_column: str | None = None
    running_states: frozenset[str] = frozenset()
    optional: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TargetSpec:
    """One database target: its parent table and the rows that hang off it.

    Delete order: `children`, then `parent`, then `after`. When there are children the
    parent rows are locked first (SELECT ... FOR UPDATE), the order KFP's own DeleteRun and
    its garbage collector use, so lapse and KFP never wait on each other in opposite
    orders. A child whose foreign key (found in the reflected schema) points at a parent
    column other than the parent's key column is matched through the locked parent rows.
    """

    name: str
    config_key: str
    key: KeySource
    parent: Step
    children: tuple[Step, ...] = ()
    after: tuple[Step, ...] = ()
    guard: Guard | None = None
    # "mlmd": the rows are ML Metadata's graph around the parent row (its run context),
    # read and deleted by the database edge's MLMD module, never by the generic steps.
    graph: Literal["mlmd"] | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        return (*self.children, self.parent, *self.after)

    @property
    def locks_parent(self) -> bool:
        return bool(self.children)

    @property
    def namespace_column(self) -> str | None:
        """Where the parent table records whose run a row is: when set, a run's rows are
        deleted only if its parent row is there and names the run's namespace."""
        return self.parent.namespace_column


# --- from configuration ----------------------------------------------------------------
# Structural views of `lapse.config`'s models, so this package need not import `lapse`.


class ChildDeclaration(Protocol):
    @property
    def table(self) -> str: ...
    @property
    def foreign_key_column(self) -> str: ...


class TableDeclaration(Protocol):
    @property
    def finished_column(self) -> str | None: ...
    @property
    def name(self) -> str: ...
    @property
    def table(self) -> str: ...
    @property
    def key_column(self) -> str: ...
    @property
    def key_from(self) -> str: ...
    @property
    def namespace_column(self) -> str | None: ...
    @property
    def children(self) -> Sequence[ChildDeclaration]: ...


class Enabled(Protocol):
    @property
    def enabled(self) -> bool: ...


class KfpDeclaration(Enabled, Protocol):
    @property
    def single_user_namespace(self) -> str: ...


class ArgoArchiveDeclaration(Enabled, Protocol):
    @property
    def cluster_name(self) -> str: ...


class MlMetadataDeclaration(Enabled, Protocol):
    @property
    def database(self) -> str | None: ...


class TargetsDeclaration(Protocol):
    @property
    def tekton_results(self) -> Enabled: ...
    @property
    def kfp(self) -> KfpDeclaration: ...
    @property
    def ml_metadata(self) -> MlMetadataDeclaration: ...
    @property
    def argo_archive(self) -> ArgoArchiveDeclaration: ...
    @property
    def tables(self) -> Sequence[TableDeclaration]: ...


def kfp_target(
    config_key: str = "database.targets.kfp",
    single_user_namespace: str = KFP_SINGLE_USER_NAMESPACE,
) -> TargetSpec:
    """KFP's run tables, in KFP's own delete order (storage/run_store.go DeleteRun).
    `single_user_namespace`: whose runs those are that KFP records with no namespace."""

    def step(table: str, column: str, *where: tuple[str, str]) -> Step:
        return Step(table, column, config_key, config_key, tuple(where))

    return TargetSpec(
        name=KFP,
        config_key=config_key,
        key=KeySource("kfp_run_id"),
        # The run id is the tenant's label; run_details.Namespace is KFP's own record of
        # whose run it is (written by KFP's API server from the run's request).
        parent=Step(
            "run_details",
            "UUID",
            config_key,
            config_key,
            namespace_column=KFP_NAMESPACE_COLUMN,
            namespace_default=single_user_namespace,
        ),
        children=(
            step("run_metrics", "RunUUID"),
            step("tasks", "RunUUID"),
            # No foreign key to run_details, so no cascade would ever remove these.
            step(
                "resource_references",
                "ResourceUUID",
                ("ResourceType", KFP_RUN_RESOURCE_TYPE),
            ),
        ),
        # KFP's own record: FinishedAtInSec is 0 until the run ends; State (KFP v2's
        # runtime state, absent from v1 schemas) goes back to RUNNING on a retry.
        guard=Guard(
            finished_column="FinishedAtInSec",
            state_column="State",
            running_states=KFP_RUNNING_STATES,
            optional=frozenset({"State"}),
        ),
    )


def argo_archive_target(
    cluster_name: str, config_key: str = "database.targets.argo_archive"
) -> TargetSpec:
    """Argo's workflow archive for one cluster, and the run's offloaded node status."""
    cluster = ("clustername", cluster_name)

    def step(table: str, namespace_column: str | None = None) -> Step:
        return Step(table, "uid", config_key, config_key, (cluster,), namespace_column)

    return TargetSpec(
        name=ARGO_ARCHIVE,
        config_key=config_key,
        key=KeySource("uid"),
        # Both of Argo's tables that record the namespace hold the delete to it.
        parent=step("argo_archived_workflows", ARGO_NAMESPACE_COLUMN),
        # ON DELETE CASCADE would remove the labels too, but only on InnoDB/PostgreSQL and
        # without telling us how many: deleting them first is exact everywhere.
        children=(step("argo_archived_workflows_labels"),),
        after=(step(ARGO_OFFLOAD_TABLE, ARGO_NAMESPACE_COLUMN),),
        guard=Guard(
            finished_column="finishedat",
            state_column="phase",
            running_states=frozenset({"Pending", "Running", ""}),
        ),
    )


def mlmd_target(
    database: str | None, config_key: str = "database.targets.ml_metadata"
) -> TargetSpec:
    """A KFP run's ML Metadata: its `system.PipelineRun` context (named by the KFP run id)
    and what hangs off it (functions/row_reaper/mlmd.py). `database`: the MySQL database
    (PostgreSQL schema) MLMD's tables are in, when not database.url's own (KFP: metadb)."""
    context = f"{database}.Context" if database else "Context"
    return TargetSpec(
        name=ML_METADATA,
        config_key=config_key,
        key=KeySource("kfp_run_id"),
        parent=Step(context, "name", config_key, config_key),
        graph="mlmd",
    )


def tekton_results_target(config_key: str = "database.targets.tekton_results") -> TargetSpec:
    """Tekton Results' rows of a PipelineRun or standalone TaskRun: the Result its watcher
    named by the run's uid (a PipelineRun's TaskRuns, logs and event lists are records of
    that same Result, named by their owner's uid) and its records (tektoncd/results
    pkg/api/server/db/model.go; pkg/watcher/results: resultName, defaultName)."""

    def step(table: str, column: str) -> Step:
        return Step(table, column, config_key, config_key)

    return TargetSpec(
        name=TEKTON_RESULTS,
        config_key=config_key,
        key=KeySource("uid"),
        parent=step("results", "name"),
        # records' foreign key is (parent, result_id) -> results (parent, id), with ON
        # DELETE CASCADE; deleting them first by result_name counts them exactly.
        children=(step("records", "result_name"),),
        # The watcher's summary of the run: its end time, NULL while it runs.
        guard=Guard(finished_column="recordsummary_end_time"),
    )


def table_target(declared: TableDeclaration, config_key: str) -> TargetSpec:
    """A user-declared table and its children (deleted first, in the declared order)."""
    children = tuple(
        Step(
            child.table,
            child.foreign_key_column,
            f"{config_key}.children[{i}].table",
            f"{config_key}.children[{i}].foreign_key_column",
        )
        for i, child in enumerate(declared.children)
    )
    return TargetSpec(
        name=declared.name,
        config_key=config_key,
        key=KeySource.parse(declared.key_from),
        parent=Step(
            declared.table,
            declared.key_column,
            f"{config_key}.table",
            f"{config_key}.key_column",
            namespace_column=declared.namespace_column,
        ),
        children=children,
        guard=Guard(declared.finished_column) if declared.finished_column else None,
    )


def targets_for(config: TargetsDeclaration, prefix: str = "database.targets") -> list[TargetSpec]:
    """Every enabled target, built-ins first, in configuration order."""
    targets = []
    if config.kfp.enabled:
        targets.append(kfp_target(f"{prefix}.kfp", config.kfp.single_user_namespace))
    if config.argo_archive.enabled:
        targets.append(
            argo_archive_target(config.argo_archive.cluster_name, f"{prefix}.argo_archive")
        )
    if config.ml_metadata.enabled:
        targets.append(mlmd_target(config.ml_metadata.database, f"{prefix}.ml_metadata"))
    if config.tekton_results.enabled:
        targets.append(tekton_results_target(f"{prefix}.tekton_results"))
    targets.extend(
        table_target(declared, f"{prefix}.tables[{i}]") for i, declared in enumerate(config.tables)
    )
    return targets


# --- for one run -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunKeys:
    """A run's key for each target that has one, and why the others were skipped."""

    keys: dict[str, str]
    skipped: dict[str, str]


def keys_for(run: RunRef, targets: Sequence[TargetSpec]) -> RunKeys:
    keys: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for target in targets:
        try:
            keys[target.name] = target.key.of(run)
        except MissingKey as exc:
            skipped[target.name] = exc.reason
    return RunKeys(keys, skipped)
