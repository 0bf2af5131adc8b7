"""What `lapse plan` says a run's artifacts target will delete: the run's capture, made
from its object exactly as the planner makes it (lapse/functions/artifact_reaper/capture.py),
judged as the reaper will judge it, and, only when asked (`--list-artifacts`), the objects
and bytes under it in the stores.

Cheap by default: the capture needs the run object (already read) and, for an Argo run
whose artifacts name no bucket, its artifact repository's ConfigMap (read once per
ConfigMap). Neither says a size (Argo records none), and a declared prefix says no count,
so without a LIST of the store the bytes are unknown, and said to be.

Not previewed: `shared` (another pending run's capture holds the item). That is read from
the capture bucket and judged at the deadline; an item kept as shared frees less than the
listing counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from lapse.cli.output import human_bytes
from lapse.edges.artifacts import ConfigMapRepositories, ObstoreStores
from lapse.edges.rows import DatabaseUnavailable, SchemaMismatch, SqlRowStore
from lapse.events.artifacts import Provider, RunArtifacts
from lapse.events.run import RunRef
from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture, capture
from lapse.functions.artifact_reaper.ports import ObjectStores, StoredObject
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.artifact_reaper.verdict import Allowed, belongs, judge
from lapse.functions.ports import RetryLater
from lapse.functions.reaping import failures
from lapse.functions.row_reaper import targets_for
from lapse.functions.row_reaper.mlmd import DELETE_ORDER as MLMD_TABLES
from lapse.functions.row_reaper.ports import Counted, Rejected, RunRows, Unavailable
from lapse.functions.row_reaper.targets import keys_for
from lapse.runtime.resources import Resources


@dataclass(frozen=True)
class ArtifactFootprint:
    """One run's artifacts, as `lapse plan` previews them."""

    keys: int  # recorded artifacts (an object, or a directory of them)
    prefixes: int  # declared prefixes: every object under each
    refused: int  # captured, but the reaper will refuse them (outside a root, too shallow)
    outside: int  # recorded in no configured store: never touched
    left_to: str | None = None  # the engine collects them itself (Argo's artifactGC)
    objects: int | None = None  # None: not listed
    bytes: int | None = None
    listed: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "artifacts": self.keys,
            "prefixes": self.prefixes,
            "objects": self.objects,
            "bytes": self.bytes,
            "listed": self.listed,
            "refused": self.refused,
            "outside": self.outside,
            "leftTo": self.left_to,
        }

    @classmethod
    def from_json(cls, found: Mapping[str, Any]) -> ArtifactFootprint:
        return cls(
            keys=found["artifacts"],
            prefixes=found["prefixes"],
            refused=found["refused"],
            outside=found["outside"],
            left_to=found["leftTo"],
            objects=found["objects"],
            bytes=found["bytes"],
            listed=found["listed"],
        )


@dataclass
class Footprints:
    """Previews the artifacts of many runs; reads each repository ConfigMap once."""

    resources: Resources
    config: ArtifactsConfig
    listing: bool = False
    notes: list[str] = field(default_factory=list)
    _repositories: ConfigMapRepositories | None = None
    _buckets: dict[tuple[str, str, str | None], dict[str, str]] = field(default_factory=dict)
    _stores: ObjectStores | None = None

    async def of(
        self, run: RunRef, kind_name: str, recorded: RunArtifacts | None
    ) -> ArtifactFootprint:
        captured = capture(run, kind_name, recorded, self.config, await self._repository(recorded))
        allowed = [
            item
            for item in captured.items
            if isinstance(judge(item, self.config, (), run, captured.kind), Allowed)
        ]
        found = ArtifactFootprint(
            keys=sum(1 for item in captured.items if not item.tree),
            prefixes=sum(1 for item in captured.items if item.tree),
            refused=len(captured.items) - len(allowed),
            outside=len(captured.outside),
            left_to=captured.collected_by_engine,
        )
        if found.left_to is not None:
            return found  # the engine deletes them; lapse lists nothing it will not delete
        if not self.listing:
            return found
        listed = await self._listed(run, captured, allowed)
        if listed is None:
            return found
        return ArtifactFootprint(
            keys=found.keys,
            prefixes=found.prefixes,
            refused=found.refused,
            outside=found.outside,
            objects=len(listed),
            bytes=sum(obj.size for obj in listed),
            listed=True,
        )

    async def _repository(self, recorded: RunArtifacts | None) -> Mapping[Provider, str]:
        ref = recorded.repository if recorded else None
        if ref is None:
            return {}
        key = (ref.namespace, ref.config_map, ref.key)
        if key not in self._buckets:
            if self._repositories is None:
                self._repositories = ConfigMapRepositories(
                    self.resources.kube_client(), self.resources.kube_executor()
                )
            try:
                buckets = await self._repositories.buckets(*key)
            except RetryLater as exc:
                self.notes.append(f"artifact repository {ref.namespace}/{ref.config_map}: {exc}")
                buckets = {}
            self._buckets[key] = buckets
        return {cast(Provider, k): v for k, v in self._buckets[key].items()}

    async def _listed(
        self, run: RunRef, captured: RunCapture, allowed: list[CapturedItem]
    ) -> list[StoredObject] | None:
        """The objects the reaper would list under the allowed items (each once), or None
        when a store did not answer or refused (said in the notes)."""
        if self._stores is None:
            settings = self.resources.config.artifacts
            self._stores = ObstoreStores(
                self.config, timeout=settings.timeout, connect_timeout=settings.connect_timeout
            )
        found: dict[tuple[str, str], StoredObject] = {}
        try:
            for item in allowed:
                listed = await self._stores.list(item.store, item.key)
                if not item.tree and (own := await self._stores.head(item.store, item.key)):
                    listed.append(own)
                for obj in listed:
                    if belongs(item, obj.path):
                        found[(item.store, obj.path)] = obj
        except (failures.Unavailable, failures.Refused) as exc:
            self.notes.append(
                f"{run.namespace}/{run.name}: artifacts not listed ({exc}); their size is unknown"
            )
            return None
        return list(found.values())


def describe(footprint: ArtifactFootprint | None) -> str:
    """The table's cell: `2 artifacts, bytes unknown`; listed, `5 objects, 1.5 MiB`."""
    if footprint is None:
        return ""
    if footprint.left_to is not None:
        return "left to the engine (artifactGC)"
    parts = []
    if footprint.listed and footprint.objects is not None:
        parts.append(f"{footprint.objects} objects, {human_bytes(footprint.bytes)}")
    else:
        counted = [_count(footprint.keys, "artifact"), _count(footprint.prefixes, "prefix")]
        shown = [part for part in counted if part]
        parts.append(", ".join(shown) + ", bytes unknown" if shown else "nothing captured")
    if footprint.refused:
        parts.append(f"{footprint.refused} refused")
    if footprint.outside:
        parts.append(f"{footprint.outside} outside the stores")
    return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    if n == 0:
        return ""
    plural = noun + ("es" if noun.endswith("x") else "s")
    return f"{n} {noun if n == 1 else plural}"


# Per table, the rows a run's database target will delete: None where they could not be
# counted (the database did not answer).
RowCount = dict[str, int] | None


@dataclass
class RowFootprints:
    """The rows each run's database target will delete, counted by the row-reaper's own
    dry run (`SqlRowStore.delete(..., dry_run=True)`, docs/cli.md): one transaction per
    call, however many runs it carries, rolled back; nothing is committed. A database that
    does not answer is said once in the notes, and asked no more: its runs' rows are unknown.
    """

    resources: Resources
    notes: list[str] = field(default_factory=list)
    _store: SqlRowStore | None = None
    _down: bool = False

    @property
    def configured(self) -> bool:
        database = self.resources.config.database
        return bool(database.url) and bool(targets_for(database.targets))

    async def of(self, runs: Sequence[RunRef]) -> list[RowCount]:
        """One count per run, in one dry-run transaction for all of them."""
        if not runs:
            return []
        if not await self.reachable() or self._store is None:
            return [None] * len(runs)
        keyed = [keys_for(run, self._store.targets).keys for run in runs]
        asked = [i for i, keys in enumerate(keyed) if keys]
        counts: list[RowCount] = [{} for _ in runs]  # no key in any target: no rows
        rows = [RunRows(keyed[i], namespace=runs[i].namespace) for i in asked]
        results = await self._store.delete(rows, dry_run=True)
        for i, result in zip(asked, results, strict=True):
            match result:
                case Counted():
                    counts[i] = rows_per_table(result)
                case Unavailable(reason=reason):
                    return self._gone(len(runs), reason)
                case Rejected(reason=reason):
                    run = runs[i]
                    self.notes.append(f"{run.namespace}/{run.name}: rows not counted: {reason}")
                    counts[i] = None
                case _:
                    counts[i] = None
        return counts

    async def reachable(self) -> bool:
        """Whether the database answered (its schema checked once); said once if not."""
        if self._down:
            return False
        if self._store is None:
            settings = self.resources.config.database
            self._store = SqlRowStore(
                self.resources.database(),
                targets_for(settings.targets),
                timeout=settings.statement_timeout.total_seconds(),
            )
        try:
            await self._store.start()
        except (DatabaseUnavailable, SchemaMismatch) as exc:
            self._gone(0, str(exc))
            return False
        return True

    @property
    def down(self) -> bool:
        return self._down

    def _gone(self, n: int, reason: str) -> list[RowCount]:
        self._down = True
        self.notes.append(f"database rows not counted ({reason}); shown as unknown")
        return [None] * n


def rows_per_table(counted: Counted) -> dict[str, int]:
    """{table: rows}; a table name two targets share is told apart as `target.table`."""
    found: dict[str, int] = {}
    owner: dict[str, str] = {}
    for target, table, rows in counted.counts:
        name = table if owner.setdefault(table, target) == target else f"{target}.{table}"
        found[name] = found.get(name, 0) + rows
    return found


def describe_rows(rows: RowCount) -> str:
    """The ROWS cell: `run_details 1, tasks 4, mlmd 29` (ML Metadata's tables as one sum,
    tables with nothing to delete left out), `0 rows`, or `unknown`."""
    if rows is None:
        return "unknown"
    mlmd = sum(n for table, n in rows.items() if table in MLMD_TABLES)
    shown = [f"{table} {n}" for table, n in rows.items() if n and table not in MLMD_TABLES]
    if mlmd:
        shown.append(f"mlmd {mlmd}")
    return ", ".join(shown) or "0 rows"
