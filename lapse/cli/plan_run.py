"""`lapse plan`'s work: list the finished runs, plan each as the planner would, count what
each target will delete, and print the preview (lapse/cli/plan.py defines the flags)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import yaml
from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException

from lapse.cli.common import (
    UsageError,
    config_from,
    in_namespace,
    kinds_of,
    namespace_of,
    warn,
)
from lapse.cli.fleet_ask import ask_hub, from_hub
from lapse.cli.footprint import (
    ArtifactFootprint,
    Footprints,
    RowCount,
    RowFootprints,
    describe,
    describe_rows,
)
from lapse.cli.output import Column, Row, emit, resource_name
from lapse.edges.kubernetes import KubeObjects, finished_pages_within
from lapse.edges.kubernetes.policies import read_policy_objects
from lapse.events.adapters.objects import adapt
from lapse.events.artifacts import RunArtifacts
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import KindSpec
from lapse.events.models import RunFinished
from lapse.events.run import RunRef, Target
from lapse.events.timeutil import format_rfc3339, parse_rfc3339
from lapse.functions.keep_last import listed_object, listed_runs
from lapse.functions.policy import Action, Decision, Policy, counted_out, plan, with_count
from lapse.functions.policy_objects import (
    API_VERSION,
    CLUSTER_LAPSE_POLICY,
    LAPSE_POLICY,
    effective,
    ref_of,
)
from lapse.functions.ports import PendingSchedule
from lapse.functions.trust import Provenance
from lapse.functions.ttl_planner import Planner
from lapse.operations.reconcile import Options, Reconciler, RowCounts
from lapse.operations.reconcile.planner import DiscardingEmitter
from lapse.runtime.resources import Resources

if TYPE_CHECKING:
    from lapse.config import LapseConfig

PAGE_SIZE = 500


@dataclass(frozen=True)
class PlannedRun:
    run: RunRef
    decisions: dict[Target, Decision]
    object_gone: bool = False  # a KFP run whose Workflow is gone: only its rows remain
    artifacts: ArtifactFootprint | None = None  # what the artifacts target will delete
    rows: RowCount = None  # what the database target will delete, per table (None: unknown)
    rows_counted: bool = False  # counted (or tried): rows is then said, unknown or not

    def as_json(self) -> dict[str, Any]:
        targets: dict[str, dict[str, Any]] = {
            target.value: {
                "action": d.action.value,
                "deadline": format_rfc3339(d.deadline) if d.deadline else None,
                "policy": d.policy,
                "reason": d.reason,
            }
            for target, d in self.decisions.items()
        }
        artifacts = targets.get(Target.ARTIFACTS.value)
        if artifacts is not None and self.artifacts is not None:
            artifacts["footprint"] = self.artifacts.as_json()
        database = targets.get(Target.DATABASE.value)
        if database is not None and self.rows_counted:
            database["rows"] = self.rows
        return {
            "namespace": self.run.namespace,
            "name": self.run.name,
            "kind": self.run.kind,
            "apiVersion": self.run.api_version,
            "uid": self.run.uid,
            "phase": self.run.phase,
            "finishedAt": format_rfc3339(self.run.finished_at) if self.run.finished_at else None,
            "kfpRunId": self.run.kfp_run_id,
            "objectGone": self.object_gone,
            "targets": targets,
        }


# A run as plan holds it: the run, and the object it was listed as (its artifacts are read
# from the object only where the artifacts target will delete them).
Listed = tuple[RunRef, dict[str, Any]]


async def finished_listings(
    objects: KubeObjects,
    kind: KindSpec,
    namespace: str | None = None,
    pattern: str | None = None,
    selector: str | None = None,
) -> AsyncIterator[list[Listed]]:
    """The finished runs of `kind` in scope, listed page by page, in the API server's
    order: one namespace's at a time where the scope is namespaces (-n, or
    --namespace-glob's matching namespaces in turn), the cluster's at once otherwise.
    keep_last's groups never cross a namespace, so each listing is counted whole on its
    own, and plan holds one namespace's runs at a time, not the cluster's."""
    scope = namespace if namespace is not None else pattern
    pages = finished_pages_within(
        objects, kind, scope, page_size=PAGE_SIZE, label_selector=selector
    )
    held: list[Listed] = []
    held_in: str | None = None
    async for listed_in, page in pages:
        if listed_in != held_in and held:
            yield held
            held = []
        held_in = listed_in
        held += [
            (run, obj)
            for run, obj in _finished(page.items, kind)
            if in_namespace(run.namespace, namespace, pattern)
        ]
    if held:
        yield held


def _finished(items: list[dict[str, Any]], kind: KindSpec) -> list[Listed]:
    """A page's finished runs in listing order: as keep_last counts them (`listed_runs`:
    a `field:` group is read from the object listed), and, never counted, those being
    deleted (their rows still have a deadline: plan always showed them)."""
    counted = {run.uid: run for run in listed_runs(items, kind)}
    found: list[Listed] = []
    for obj in items:
        metadata = obj.get("metadata") or {}
        run = counted.get(str(metadata.get("uid", "")))
        if run is None and metadata.get("deletionTimestamp"):
            run = _adapted(obj, kind)
        if run is not None:
            found.append((run, obj))
    return found


def _adapted(obj: dict[str, Any], kind: KindSpec) -> RunRef | None:
    try:
        result = adapt(obj, kind)
    except InvalidEvent:
        return None
    return result.run if isinstance(result, RunFinished) else None


def _artifacts(obj: dict[str, Any], kind: KindSpec) -> RunArtifacts | None:
    """What the run recorded of its artifacts, read from the object as the planner reads it."""
    try:
        result = adapt(obj, kind)
    except InvalidEvent:
        return None
    return result.artifacts if isinstance(result, RunFinished) else None


class _NoSchedules:
    """The preview never schedules: `_OrphanedRows` replaces the one call that would."""

    async def get(
        self, target: Target, uid: str, *, with_due: bool = False
    ) -> PendingSchedule | None:
        raise AssertionError("lapse plan reads no schedules")

    async def put(
        self,
        target: Target,
        uid: str,
        deadline: datetime,
        due_event: BaseCloudEvent,
        *,
        provenance: Provenance,
    ) -> None:
        raise AssertionError("lapse plan writes no schedules")

    async def cancel(self, target: Target, uid: str) -> bool:
        raise AssertionError("lapse plan cancels no schedules")


class _OrphanedRows(Reconciler):
    """reconcile's KFP rows pass (paging, policies, the check that the Workflow is gone),
    collecting what it would schedule instead of scheduling it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.found: list[tuple[RunRef, Decision]] = []

    async def _schedule_rows(self, run: RunRef, decision: Decision, counts: RowCounts) -> None:
        self.found.append((run, decision))


@dataclass
class Preview:
    runs: list[PlannedRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said, but not failures


async def orphaned_rows(
    resources: Resources,
    namespace: str | None,
    now: datetime,
    policies: tuple[Policy, ...] | None = None,
) -> tuple[list[PlannedRun], list[str]]:
    planner = Planner(
        schedules=_NoSchedules(),
        emitter=DiscardingEmitter(),
        policies=tuple(resources.config.policies) if policies is None else policies,
    )
    options = Options(namespace=namespace, dry_run=True, runs=False, rows=True)
    rows = _OrphanedRows(resources, planner, options, clock=lambda: now)
    summary = await rows.run()
    planned = [
        PlannedRun(run, {Target.DATABASE: decision}, object_gone=True)
        for run, decision in rows.found
    ]
    return planned, list(summary.problems)


def _objects_in(path: str, namespace: str | None) -> list[dict[str, Any]]:
    """The policy objects of a YAML file, as the API server would hold them once applied."""
    try:
        with open(path) as file:
            docs = [d for d in yaml.safe_load_all(file) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"-f {path}: {exc}") from None
    found = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in (LAPSE_POLICY, CLUSTER_LAPSE_POLICY):
            raise UsageError(f"-f {path}: only {LAPSE_POLICY} and {CLUSTER_LAPSE_POLICY} objects")
        if doc.get("apiVersion") != API_VERSION:
            raise UsageError(f"-f {path}: apiVersion {doc.get('apiVersion')!r}, not {API_VERSION}")
        metadata = dict(doc.get("metadata") or {})
        if doc["kind"] == LAPSE_POLICY:
            metadata["namespace"] = metadata.get("namespace") or namespace or "default"
        found.append({**doc, "metadata": metadata})
    return found


async def _policies(
    resources: Resources, args: argparse.Namespace, namespace: str | None, result: Preview
) -> tuple[tuple[Policy, ...], set[str]]:
    """The policies in effect (lapse.yaml's and the policy objects), with -f's applied;
    and the policy objects --policy selects (`kind:namespace/name`, no generation)."""
    configured = tuple(resources.config.policies)
    namespaced, clusters, notes = await read_policy_objects(resources.objects())
    if args.filename is not None or args.policy is not None:
        result.notes += notes  # otherwise a cluster without the CRDs is nothing to say
    chosen: set[str] = set()
    if args.filename is not None:
        for obj in _objects_in(args.filename, namespace):
            ref = ref_of(obj)
            held = namespaced if obj["kind"] == LAPSE_POLICY else clusters
            current = next((o for o in held if ref_of(o).key == ref.key), None)
            generation = ref_of(current).generation + 1 if current else 1
            obj["metadata"]["generation"] = generation
            held[:] = [o for o in held if ref_of(o).key != ref.key] + [obj]
            chosen.add(_unversioned(ref_of(obj).label))
    found = effective(namespaced, clusters, configured)
    for verdict in found.verdicts:
        if _unversioned(verdict.ref.label) in chosen:
            state = "in effect" if verdict.accepted else "REFUSED"
            result.notes.append(
                f"{verdict.ref.label} ({state}): {verdict.reason}: {verdict.message}"
            )
    if args.policy:
        kind = LAPSE_POLICY if "/" in args.policy else CLUSTER_LAPSE_POLICY
        chosen = {f"{kind.lower()}:{args.policy}"}
    return found.policies, chosen


def _unversioned(label: str) -> str:
    return label.rpartition("@")[0]


async def preview(resources: Resources, args: argparse.Namespace, now: datetime) -> Preview:
    namespace, pattern = namespace_of(args)
    result = Preview()
    # Flags are checked before anything is read: a typo is a usage error, not a connection.
    wanted = kinds_of(args, resources.config.kinds)
    policies, chosen = await _policies(resources, args, namespace, result)
    # The artifacts target is planned only where object stores are configured.
    targets = tuple(
        t for t in Target if t is not Target.ARTIFACTS or resources.config.artifacts.stores
    )
    footprints = Footprints(resources, resources.config.artifacts, args.list_artifacts)
    rows = RowFootprints(resources)
    counted = args.target in (None, Target.DATABASE.value) and not args.no_rows
    counting = rows if counted and rows.configured else None
    if counting is not None:
        await counting.reachable()  # asked once up front: a database down is said once
    for kind in resources.config.kinds:
        if wanted and kind.name not in wanted:
            continue
        listings = finished_listings(resources.objects(), kind, namespace, pattern, args.selector)
        try:
            async for listed in listings:
                planned = await _preview_listing(
                    listed, kind, args, policies, chosen, targets, footprints, now
                )
                result.runs += await _with_rows(planned, counting)
        except ApiException as exc:
            if exc.status != 404:
                raise
            # Not installed here (no Tekton, no Trainer): nothing of it to plan.
            result.notes.append(f"{kind.describe()} is not served by this API server")
    result.notes += footprints.notes
    if args.selector and any(p.keep_last for p in policies):
        result.notes.append(
            "keep_last is not previewed with -l: a group is counted whole (run without -l)"
        )
    wants_rows = args.target in (None, Target.DATABASE.value) and not args.selector
    kfp_rows = not wanted or "argo-workflow" in wanted
    if counting is not None and counting.down:
        # The KFP rows pass would only fail the same way: the plan is still made, its
        # database rows unknown (said once, in the notes).
        if wants_rows and kfp_rows and resources.config.database.targets.kfp.enabled:
            rows.notes.append("KFP rows whose Workflow is gone are not previewed")
    elif wants_rows and kfp_rows and resources.config.database.targets.kfp.enabled:
        gone, result.problems = await orphaned_rows(resources, pattern or namespace, now, policies)
        result.runs += await _with_rows(gone, counting)
    result.notes += rows.notes
    return result


async def _with_rows(planned: list[PlannedRun], rows: RowFootprints | None) -> list[PlannedRun]:
    """The runs, each whose database target is scheduled with the rows it will delete:
    counted a page of runs at a time, each page in one dry-run transaction."""
    if rows is None:
        return planned
    due = [
        i
        for i, p in enumerate(planned)
        if (d := p.decisions.get(Target.DATABASE)) is not None and d.action is Action.SCHEDULE
    ]
    counted = list(planned)
    for start in range(0, len(due), PAGE_SIZE):
        page = due[start : start + PAGE_SIZE]
        found = await rows.of([planned[i].run for i in page])
        for i, count in zip(page, found, strict=True):
            counted[i] = replace(planned[i], rows=count, rows_counted=True)
    return counted


async def _preview_listing(
    listed: list[Listed],
    kind: KindSpec,
    args: argparse.Namespace,
    policies: tuple[Policy, ...],
    chosen: set[str],
    targets: tuple[Target, ...],
    footprints: Footprints,
    now: datetime,
) -> list[PlannedRun]:
    # keep_last counts each group among the runs listed here (a namespace's, or the
    # cluster's: a group never crosses a namespace): all of them, unless -l shows only
    # some (then the count would be wrong, and is not previewed). Runs being deleted are
    # not counted, as the planner and the reaper do not count them.
    counting = [run for run, _ in listed if listed_object(run) is not None]
    counted = {} if args.selector else counted_out(counting, policies, now)
    planned: list[PlannedRun] = []
    for run, obj in listed:
        decisions = plan(run, policies, now, targets)
        k8s = Target.KUBERNETES
        decisions[k8s] = with_count(decisions[k8s], counted.get(run.uid), run.finished_at)
        if args.policy is not None and not any(
            _unversioned(d.policy) in chosen for d in decisions.values()
        ):
            continue
        if args.target:
            decisions = {t: d for t, d in decisions.items() if t.value == args.target}
        footprint = None
        artifacts = decisions.get(Target.ARTIFACTS)
        if artifacts is not None and artifacts.action is Action.SCHEDULE:
            footprint = await footprints.of(run, kind.name, _artifacts(obj, kind))
        planned.append(PlannedRun(run, decisions, artifacts=footprint))
    return planned


# The flags `plan --fleet|--cluster` sends to each cluster (a file named by -f is on the
# hub's side: not sent, refused there).
FLEET_FLAGS = (
    "namespace", "all_namespaces", "namespace_glob", "selector", "kind", "target",
    "list_artifacts", "no_rows",
)  # fmt: skip
# How many runs one cluster's answer lists at most (a NATS message is bounded: 1 MiB).
FLEET_MAX_RUNS = 1000


def _document(result: Preview) -> dict[str, Any]:
    return {
        "items": [planned.as_json() for planned in result.runs],
        "rowsCounted": any(planned.rows_counted for planned in result.runs),
        "notes": result.notes,
        "problems": result.problems,
    }


async def plan_document(config: LapseConfig, body: dict[str, Any]) -> dict[str, Any]:
    """`lapse plan` in this cluster for a request from the fleet's hub (`body`: the
    FLEET_FLAGS the hub's command was given), as its document."""
    flags = {flag: body.get(flag) for flag in FLEET_FLAGS}
    args = argparse.Namespace(**flags, filename=None, policy=None)
    async with Resources(config) as resources:
        document = _document(await preview(resources, args, datetime.now(UTC)))
    if len(document["items"]) > FLEET_MAX_RUNS:
        document["notes"].append(f"only the first {FLEET_MAX_RUNS} runs: narrow with -n, --kind")
        document["items"] = document["items"][:FLEET_MAX_RUNS]
    return document


def run_plan(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    if from_hub(args):
        if args.filename or args.policy is not None:
            raise UsageError("-f and --policy preview policies here: not with --fleet/--cluster")
        body = {flag: getattr(args, flag) for flag in FLEET_FLAGS}
        document: dict[str, Any] = {"items": [], "rowsCounted": False, "notes": [], "problems": []}
        for answer in ask_hub(args, "plan", body):
            cluster = answer["cluster"]
            document["items"] += [{"cluster": cluster, **row} for row in answer["items"]]
            document["rowsCounted"] = document["rowsCounted"] or answer["rowsCounted"]
            for key in ("notes", "problems"):
                document[key] += [f"{cluster}: {said}" for said in answer[key]]
        shown = [CLUSTER, *columns(now, **_shown(document))]
    else:
        config = config_from(args)

        async def collect() -> Preview:
            async with Resources(config) as resources:
                return await preview(resources, args, now)

        document = _document(asyncio.run(collect()))
        shown = columns(now, **_shown(document))
    emit(document["items"], shown, args, sys.stdout, name=_name)
    for problem in [*document["notes"], *document["problems"]]:
        warn(problem)
    return 1 if document["problems"] else 0


def _shown(document: dict[str, Any]) -> dict[str, bool]:
    rows = document["items"]
    artifacts = any(Target.ARTIFACTS.value in row["targets"] for row in rows)
    return {"artifacts": artifacts, "rows": bool(document["rowsCounted"])}


CLUSTER = Column("CLUSTER", lambda r: r["cluster"])


def _name(row: Row) -> str:
    return resource_name(row["apiVersion"], row["kind"], row["name"])


def _describe(target: str, now: datetime) -> Any:
    def cell(row: Row) -> str:
        decision = row["targets"].get(target)
        if decision is None:
            return "(object gone)" if row["objectGone"] else ""
        if decision["action"] == "cancel":
            return "never"
        if decision["action"] == "invalid":
            return "invalid"
        seconds = (parse_rfc3339(decision["deadline"]) - now).total_seconds()
        when = "due now" if seconds <= 0 else f"in {_human(seconds)}"
        return f"{decision['deadline']} ({when})"

    return cell


def _policy(target: str) -> Any:
    return lambda row: (row["targets"].get(target) or {}).get("policy")


def _footprint(row: Row) -> str:
    found = (row["targets"].get(Target.ARTIFACTS.value) or {}).get("footprint")
    return describe(ArtifactFootprint.from_json(found) if found else None)


def _rows(row: Row) -> str:
    database = row["targets"].get(Target.DATABASE.value) or {}
    return describe_rows(database["rows"]) if "rows" in database else ""


def columns(now: datetime, *, artifacts: bool = False, rows: bool = False) -> list[Column]:
    """The table's columns; the artifacts target's only where a run has one (artifacts.stores
    configured), so a deployment without object stores sees the table it always did; ROWS
    only where rows were counted (a database configured, and not --no-rows)."""
    shown = [
        Column("NAMESPACE", lambda r: r["namespace"]),
        Column("NAME", lambda r: r["name"]),
        Column("KIND", lambda r: r["kind"]),
        Column("PHASE", lambda r: r["phase"]),
        Column("KUBERNETES", _describe("kubernetes", now)),
        Column("BY", _policy("kubernetes")),
        Column("DATABASE", _describe("database", now)),
        Column("BY", _policy("database")),
    ]
    if rows:
        shown.append(Column("ROWS", _rows))
    if artifacts:
        shown += [
            Column("ARTIFACTS", _describe(Target.ARTIFACTS.value, now)),
            Column("BY", _policy(Target.ARTIFACTS.value)),
            Column("WILL DELETE", _footprint),
        ]
    return [
        *shown,
        Column("FINISHED", lambda r: r["finishedAt"], wide_only=True),
        Column("UID", lambda r: r["uid"], wide_only=True),
        Column("KFP RUN", lambda r: r["kfpRunId"], wide_only=True),
    ]


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
