"""Re-deriving schedules from what exists: the backfill after installing lapse on a cluster
full of old runs, and a periodic safety net.

Two passes, each paged so memory stays flat whatever the size of the cluster or database:

1. Finished Workflows (server-side selection on Argo's `completed` label), each handed to
   the ttl-planner as a `run.finished` event, exactly as if the watcher had seen it finish.
   The planner leaves an unchanged deadline alone, so running reconcile again is harmless.
2. KFP run rows whose Workflow is gone and whose database deadline has passed. Nothing else
   would ever schedule them (the planner only hears of runs that still have an object), so
   their database deadline is decided here and scheduled through the planner, keyed by the
   KFP run id.

Reconcile only schedules. Past-due deadlines fire at once and the reapers pace the
deletions (`safety.max_deletions_per_second`, the mass-deletion brake).

Why whole Workflows and not a metadata-only list: the planner needs `status.finishedAt`,
`status.phase` and `spec.ttlStrategy`, which PartialObjectMetadata leaves out (and Argo's
printer columns, the only other projection the API server offers, carry no finishedAt);
fetching metadata first and then each object would cost one GET per run. So pages are
small and handled one at a time (with the next one prefetched), and memory is bounded by
two pages whatever the cluster holds. Where only existence matters (does a KFP run still
have a Workflow?) the list is metadata-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import re
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal, Protocol

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sqlalchemy import Row, column, func, select, table
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

from events.adapters import adapt_workflow, argo
from events.builder import build_event
from events.errors import InvalidEvent
from events.models import RunFinished
from events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from events.types import EventType
from functions.policy import Action, Decision, Policy, decide
from functions.ports import PendingSchedule, ScheduleStore
from functions.ttl_planner import Planner
from lapse.config import Streams
from lapse.edges.kubernetes import (
    Page,
    api_failure,
    finished_workflow_pages,
    list_workflow_metadata,
)
from lapse.errors import LapseError
from lapse.runtime.resources import Resources

SOURCE: Final = "/lapse/reconcile"
# Whole objects are listed (the planner needs status and spec, which a metadata-only list
# lacks), so pages are kept small: a page is what reconcile holds, twice with the prefetch.
DEFAULT_PAGE_SIZE: Final = 100
DEFAULT_ROW_PAGE_SIZE: Final = 1000
DEFAULT_CONCURRENCY: Final = 64
# Run ids per `pipeline/runid in (...)` selector: about 2 KB of query string.
RUN_ID_CHUNK: Final = 50
LIST_CONCURRENCY: Final = 4
# Past this many failed plannings the cause is not one bad run (NATS is gone, or lapse
# lacks a permission): stop instead of failing every remaining run slowly.
MAX_ERRORS: Final = 50
# KFP in single-user mode leaves run_details.Namespace empty; its runs live in the
# namespace KFP is installed in, by default this one.
KFP_DEFAULT_NAMESPACE: Final = "kubeflow"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_GLOB_CHARS = re.compile(r"[*?\[]")
# KFP v2 run states (and v1 `Conditions`) as the Argo phase words the audit trail uses.
_KFP_PHASES: Final = {
    "SUCCEEDED": "Succeeded",
    "SKIPPED": "Succeeded",
    "FAILED": "Failed",
    "CANCELED": "Failed",
    "Succeeded": "Succeeded",
    "Skipped": "Succeeded",
    "Failed": "Failed",
    "Error": "Error",
    "Terminated": "Failed",
}

_RUN_DETAILS = table(
    "run_details",
    column("UUID"),
    column("Namespace"),
    column("Name"),
    column("FinishedAtInSec"),
    column("State"),
    column("Conditions"),
)


class ReconcileError(LapseError):
    """Reconcile cannot go on (one line, for the command line)."""


class Progress(Protocol):
    """Where reconcile reports how far it got; `total` is None when unknown up front."""

    def start(self, phase: str, total: int | None) -> None: ...

    def advance(self, phase: str, count: int) -> None: ...

    def finish(self, phase: str) -> None: ...


class NoProgress:
    def start(self, phase: str, total: int | None) -> None:
        pass

    def advance(self, phase: str, count: int) -> None:
        pass

    def finish(self, phase: str) -> None:
        pass


@dataclass(frozen=True)
class Options:
    namespace: str | None = None  # a name or a glob; runs and rows outside it are left alone
    dry_run: bool = False
    runs: bool = True
    rows: bool = True
    page_size: int = DEFAULT_PAGE_SIZE
    row_page_size: int = DEFAULT_ROW_PAGE_SIZE
    concurrency: int = DEFAULT_CONCURRENCY


@dataclass
class RunCounts:
    """Finished Workflows: each listed one lands in exactly one of the outcome buckets."""

    listed: int = 0
    scheduled: int = 0  # at least one deadline set or moved
    unchanged: int = 0  # every deadline already pending (or already fired)
    cancelled: int = 0  # a pending deadline withdrawn (keep, never)
    failed: int = 0  # the planner refused the run (e.g. a malformed annotation): dead-lettered
    ignored: int = 0  # labelled completed but not in a terminal phase, or not a Workflow
    errors: int = 0  # could not be planned (NATS trouble): try reconcile again
    deadlines: Counter[str] = field(default_factory=Counter)  # set or moved, per target

    def record(self, emitted: Sequence[BaseCloudEvent]) -> None:
        """Count one planned run by what the planner emitted for it."""
        outcome = plan_outcome(emitted)
        if outcome == "failed":
            self.failed += 1
        elif outcome == "scheduled":
            self.scheduled += 1
        elif outcome == "cancelled":
            self.cancelled += 1
        else:
            self.unchanged += 1
        self.deadlines.update(scheduled_targets(emitted))

    def as_json(self) -> dict[str, Any]:
        return {
            "listed": self.listed,
            "scheduled": self.scheduled,
            "unchanged": self.unchanged,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "ignored": self.ignored,
            "errors": self.errors,
            "deadlines": {t.value: self.deadlines[t.value] for t in Target},
        }


@dataclass
class RowCounts:
    """Finished KFP runs in the database (FinishedAtInSec set), in the namespace filter."""

    considered: int = 0
    never: int = 0  # the database policy keeps them forever
    not_due: int = 0  # database deadline still ahead: a later reconcile, or the planner
    live: int = 0  # past due but the Workflow exists: the runs pass schedules those
    orphaned: int = 0  # past due and the Workflow is gone: scheduled here
    scheduled: int = 0
    unchanged: int = 0
    failed: int = 0
    errors: int = 0
    invalid: int = 0  # rows that do not make a run reference (not counted as considered)

    def as_json(self) -> dict[str, Any]:
        return {
            "considered": self.considered,
            "never": self.never,
            "notDue": self.not_due,
            "live": self.live,
            "orphaned": self.orphaned,
            "scheduled": self.scheduled,
            "unchanged": self.unchanged,
            "failed": self.failed,
            "errors": self.errors,
            "invalid": self.invalid,
        }


@dataclass
class ReconcileSummary:
    dry_run: bool
    namespace: str | None
    runs: RunCounts | None = None
    rows: RowCounts | None = None
    rows_skipped: str | None = None  # why the rows pass did not run
    seconds: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        errors = (self.runs.errors if self.runs else 0) + (self.rows.errors if self.rows else 0)
        return not self.problems and errors == 0

    def as_json(self) -> dict[str, Any]:
        rows: dict[str, Any] | None = self.rows.as_json() if self.rows else None
        if self.rows_skipped is not None:
            rows = {"skipped": self.rows_skipped}
        return {
            "dryRun": self.dry_run,
            "namespace": self.namespace,
            "runs": self.runs.as_json() if self.runs else None,
            "rows": rows,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "problems": self.problems,
        }


# --- schedule stores ----------------------------------------------------------------------


class ReadOnlySchedules:
    """--dry-run: reads the real schedules, so the counts say what a real run would change,
    and writes nothing."""

    def __init__(self, store: ScheduleStore) -> None:
        self._store = store

    async def get(self, target: Target, uid: str) -> PendingSchedule | None:
        return await self._store.get(target, uid)

    async def put(
        self, target: Target, uid: str, deadline: datetime, due_event: BaseCloudEvent
    ) -> None:
        pass

    async def cancel(self, target: Target, uid: str) -> bool:
        return await self._store.get(target, uid) is not None


class DiscardingEmitter:
    async def emit(self, event: BaseCloudEvent) -> None:
        pass


async def check_streams(js: JetStreamContext, streams: Streams) -> None:
    for name in (streams.schedule, streams.audit, streams.dlq):
        try:
            await js.stream_info(name)
        except NotFoundError:
            raise ReconcileError(
                f"NATS stream {name} does not exist: run `lapse infra apply` "
                "(or start `lapse up`) first"
            ) from None


async def build_planner(resources: Resources, *, dry_run: bool) -> Planner:
    js = await resources.jetstream()
    streams = resources.config.nats.streams
    await check_streams(js, streams)
    store: ScheduleStore = await resources.schedules()
    if dry_run:
        store = ReadOnlySchedules(store)
    return Planner(
        schedules=store,
        emitter=DiscardingEmitter() if dry_run else await resources.emitter(),
        policies=tuple(resources.config.policies),
    )


# --- small helpers ------------------------------------------------------------------------


def namespace_matches(namespace: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(namespace, pattern)


def is_glob(pattern: str) -> bool:
    return bool(_GLOB_CHARS.search(pattern))


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))


PlanOutcome = Literal["scheduled", "unchanged", "cancelled", "failed"]


def plan_outcome(emitted: Sequence[BaseCloudEvent]) -> PlanOutcome:
    """The one bucket a planned run lands in, from what the planner emitted."""
    types = {event.get_type() for event in emitted}
    if EventType.CLEANUP_FAILED in types:
        return "failed"
    if EventType.CLEANUP_SCHEDULED in types:
        return "scheduled"
    if EventType.CLEANUP_CANCELLED in types:
        return "cancelled"
    return "unchanged"


def scheduled_targets(emitted: Sequence[BaseCloudEvent]) -> list[str]:
    return [
        str(event.get_extension("target"))
        for event in emitted
        if event.get_type() == EventType.CLEANUP_SCHEDULED
    ]


def one_line(exc: BaseException) -> str:
    failure = api_failure(exc)
    if failure is not None:
        status = f"HTTP {failure.status}: " if failure.status else ""
        return f"{status}{failure.message}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def bounded(work: Iterable[Awaitable[None]], limit: int) -> None:
    """Await every item with at most `limit` in flight."""
    slots = asyncio.Semaphore(limit)

    async def one(item: Awaitable[None]) -> None:
        async with slots:
            await item

    await asyncio.gather(*(one(item) for item in work))


async def prefetched(pages: AsyncIterator[Page]) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The items of each page; the next page is already being fetched while the caller
    works on this one, so the API round trip overlaps the planning."""
    pending: asyncio.Future[Page] | None = asyncio.ensure_future(anext(pages))
    try:
        while pending is not None:
            try:
                page = await pending
            except StopAsyncIteration:
                return
            pending = asyncio.ensure_future(anext(pages))
            yield page.items
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


# --- kfp rows -----------------------------------------------------------------------------


def kfp_run(row: Row[Any]) -> RunRef:
    """The run reference a KFP row stands for, as the policies see it: engine argo, the
    row's namespace, and the run id label KFP puts on the run's Workflow. The uid is the run
    id, because the Workflow (and its uid) is gone; it keys the database schedule."""
    uuid = str(row.UUID)
    state = str(row.State or "")
    conditions = str(row.Conditions or "")
    return RunRef(
        engine=Engine.ARGO,
        api_version=argo.DEFAULT_API_VERSION,
        kind=argo.KIND,
        namespace=str(row.Namespace or "") or KFP_DEFAULT_NAMESPACE,
        name=str(row.Name or "") or uuid,
        uid=uuid,
        phase=_KFP_PHASES.get(conditions) or _KFP_PHASES.get(state, ""),
        finished_at=datetime.fromtimestamp(int(row.FinishedAtInSec), UTC),
        labels={KFP_RUN_ID_LABEL: uuid},
        kfp_run_id=uuid,
    )


async def finished_kfp_rows(engine: AsyncEngine, after: str, limit: int) -> Sequence[Row[Any]]:
    """The next page of finished runs by run id (keyset pagination: each page is an index
    range scan, however deep into the table it is)."""
    t = _RUN_DETAILS
    query = (
        select(t.c.UUID, t.c.Namespace, t.c.Name, t.c.FinishedAtInSec, t.c.State, t.c.Conditions)
        .where(t.c.FinishedAtInSec > 0, t.c["UUID"] > after)
        .order_by(t.c.UUID)
        .limit(limit)
    )
    async with engine.connect() as conn:
        return (await conn.execute(query)).all()


def database_problem(exc: BaseException) -> str:
    if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        text = one_line(exc.orig)
        if isinstance(exc, sa_exc.ProgrammingError) and "run_details" in text:
            return f"{text} (is database.url KFP's database, e.g. mlpipeline?)"
        return text
    return one_line(exc)


async def count_finished_kfp_rows(engine: AsyncEngine) -> int:
    t = _RUN_DETAILS
    async with engine.connect() as conn:
        count = await conn.scalar(
            select(func.count()).select_from(t).where(t.c.FinishedAtInSec > 0)
        )
    return int(count or 0)


# --- the passes ---------------------------------------------------------------------------


class Reconciler:
    def __init__(
        self,
        resources: Resources,
        planner: Planner,
        options: Options,
        progress: Progress | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.resources = resources
        self.planner = planner
        self.options = options
        self.progress: Progress = progress or NoProgress()
        self.clock = clock
        self.policies: tuple[Policy, ...] = tuple(resources.config.policies)
        self.problems: list[str] = []

    async def run(self) -> ReconcileSummary:
        summary = ReconcileSummary(
            self.options.dry_run, self.options.namespace, problems=self.problems
        )
        if self.options.rows:
            summary.rows_skipped = self.rows_unavailable()
            if summary.rows_skipped is None:
                self.resources.database()  # no database.url is a usage error: before any work
        if self.options.runs:
            started = time.monotonic()
            summary.runs = await self.reconcile_runs()
            summary.seconds["runs"] = time.monotonic() - started
        if self.options.rows and summary.rows_skipped is None:
            started = time.monotonic()
            summary.rows = await self.reconcile_kfp_rows()
            summary.seconds["rows"] = time.monotonic() - started
        return summary

    def note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    # runs ---------------------------------------------------------------------------------

    async def reconcile_runs(self) -> RunCounts:
        counts = RunCounts()
        self.progress.start("runs", None)
        try:
            pages = finished_workflow_pages(
                self.resources.workflows(), self._list_namespace(), page_size=self.options.page_size
            )
            async with aclosing(prefetched(pages)) as items:
                await self._plan_pages(items, counts)
        except ApiException as exc:
            raise ReconcileError(f"listing finished Workflows failed: {one_line(exc)}") from exc
        finally:
            self.progress.finish("runs")
        return counts

    async def _plan_pages(
        self, pages: AsyncIterator[list[dict[str, Any]]], counts: RunCounts
    ) -> None:
        async for items in pages:
            in_scope = [obj for obj in items if self._in_scope(obj)]
            await bounded((self._plan(obj, counts) for obj in in_scope), self.options.concurrency)
            self.progress.advance("runs", len(in_scope))
            if counts.errors > MAX_ERRORS:
                raise ReconcileError(
                    f"gave up after {counts.errors} runs could not be planned: {self.problems[0]}"
                )

    def _list_namespace(self) -> str | None:
        pattern = self.options.namespace
        return pattern if pattern is not None and not is_glob(pattern) else None

    def _in_scope(self, obj: dict[str, Any]) -> bool:
        namespace = obj.get("metadata", {}).get("namespace", "")
        return namespace_matches(str(namespace), self.options.namespace)

    async def _plan(self, obj: dict[str, Any], counts: RunCounts) -> None:
        counts.listed += 1
        try:
            finished = adapt_workflow(obj)
        except InvalidEvent:
            counts.ignored += 1
            return
        if not isinstance(finished, RunFinished):
            counts.ignored += 1
            return
        try:
            emitted = await self.planner.handle(self._event(obj, finished))
        except Exception as exc:  # NATS trouble: counted and reported, the rest goes on
            counts.errors += 1
            self.note(f"planning {finished.run.subject}: {one_line(exc)}")
            return
        counts.record(emitted)

    @staticmethod
    def _event(obj: dict[str, Any], finished: RunFinished) -> BaseCloudEvent:
        metadata = obj["metadata"]
        # The watcher's id for the same object version: one finish, one id, whoever saw it.
        event_id = (
            f"{metadata['uid']}.{metadata.get('resourceVersion', '')}.{EventType.RUN_FINISHED}"
        )
        return build_event(EventType.RUN_FINISHED, source=SOURCE, data=finished, id=event_id)

    # rows ---------------------------------------------------------------------------------

    def rows_unavailable(self) -> str | None:
        if not self.resources.config.database.targets.kfp.enabled:
            return "database.targets.kfp is not enabled"
        return None

    async def reconcile_kfp_rows(self) -> RowCounts:
        counts = RowCounts()
        engine = self.resources.database()
        try:
            self.progress.start("rows", await count_finished_kfp_rows(engine))
            after = ""
            while rows := await finished_kfp_rows(engine, after, self.options.row_page_size):
                after = str(rows[-1].UUID)
                await self._row_page(rows, counts)
                self.progress.advance("rows", len(rows))
                if counts.errors > MAX_ERRORS:
                    raise ReconcileError(
                        f"gave up after {counts.errors} KFP runs could not be scheduled: "
                        f"{self.problems[0]}"
                    )
        except (sa_exc.SQLAlchemyError, OSError, TimeoutError) as exc:
            self.note(f"KFP rows: {database_problem(exc)}")
        except ApiException as exc:
            self.note(f"KFP rows: looking up their Workflows failed: {one_line(exc)}")
        finally:
            self.progress.finish("rows")
        return counts

    async def _row_page(self, rows: Sequence[Row[Any]], counts: RowCounts) -> None:
        now = self.clock()
        past_due: list[tuple[RunRef, Decision]] = []
        for row in rows:
            try:
                run = kfp_run(row)
            except (ValueError, OverflowError, OSError):  # pydantic's errors are ValueErrors
                counts.invalid += 1  # e.g. a FinishedAtInSec past year 9999: left alone
                continue
            if not namespace_matches(run.namespace, self.options.namespace):
                continue
            counts.considered += 1
            decision = decide(run, Target.DATABASE, self.policies, now)
            if decision.action is not Action.SCHEDULE or decision.deadline is None:
                counts.never += 1
            elif decision.deadline > now:
                counts.not_due += 1
            else:
                past_due.append((run, decision))
        alive = await self._alive_run_ids([run.uid for run, _ in past_due])
        orphans = [(run, decision) for run, decision in past_due if run.uid not in alive]
        counts.live += len(past_due) - len(orphans)
        counts.orphaned += len(orphans)
        await bounded(
            (self._schedule_rows(run, d, counts) for run, d in orphans), self.options.concurrency
        )

    async def _schedule_rows(self, run: RunRef, decision: Decision, counts: RowCounts) -> None:
        try:
            emitted = await self.planner.apply(run, decision)
        except Exception as exc:  # NATS trouble: counted and reported, the rest goes on
            counts.errors += 1
            self.note(f"scheduling KFP run {run.uid}: {one_line(exc)}")
            return
        outcome = plan_outcome(emitted)
        if outcome == "scheduled":
            counts.scheduled += 1
        elif outcome == "failed":
            counts.failed += 1
        else:
            counts.unchanged += 1

    async def _alive_run_ids(self, run_ids: list[str]) -> set[str]:
        """Which of these KFP run ids still have a Workflow in the cluster (any phase).

        Asked in chunks with a set-based label selector and a metadata-only list, so the
        cost follows the candidates, not the cluster. A run id that is not a valid label
        value cannot be on any Workflow.
        """
        checkable = [run_id for run_id in run_ids if is_label_value(run_id)]
        chunks = [checkable[i : i + RUN_ID_CHUNK] for i in range(0, len(checkable), RUN_ID_CHUNK)]
        found: set[str] = set()

        async def check(chunk: list[str]) -> None:
            found.update(await self._run_ids_in_cluster(chunk))

        await bounded((check(chunk) for chunk in chunks), LIST_CONCURRENCY)
        return found

    async def _run_ids_in_cluster(self, run_ids: list[str]) -> set[str]:
        selector = f"{KFP_RUN_ID_LABEL} in ({','.join(run_ids)})"
        found: set[str] = set()
        token: str | None = None
        while True:
            page = await list_workflow_metadata(
                self.resources.kube_client(),
                self.resources.kube_executor(),
                label_selector=selector,
                limit=500,
                continue_token=token,
            )
            for item in page.get("items", []):
                labels = item.get("metadata", {}).get("labels") or {}
                found.add(str(labels.get(KFP_RUN_ID_LABEL, "")))
            token = page.get("metadata", {}).get("continue")
            if not token:
                return found


async def reconcile(
    resources: Resources, options: Options, progress: Progress | None = None
) -> ReconcileSummary:
    """Both passes (as `options` says) against the configured cluster, NATS and database."""
    planner = await build_planner(resources, dry_run=options.dry_run)
    return await Reconciler(resources, planner, options, progress).run()
