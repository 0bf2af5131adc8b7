"""The two passes: finished runs of every configured kind, then KFP rows whose Workflow
is gone."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any, Final

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException
from sqlalchemy import Row
from sqlalchemy import exc as sa_exc

from lapse.edges.kubernetes import Page, finished_pages_within, list_metadata
from lapse.events.adapters.objects import adapt
from lapse.events.builder import build_event
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import ARGO_WORKFLOW, KindSpec
from lapse.events.models import RunFinished
from lapse.events.run import KFP_RUN_ID_LABEL, RunRef, Target
from lapse.events.types import EventType
from lapse.functions.policy import Action, Decision, Policy, decide
from lapse.functions.safety import out_of_scope
from lapse.functions.trust import Provenance
from lapse.functions.ttl_planner import Planner
from lapse.operations.reconcile.counts import (
    NoProgress,
    Options,
    Progress,
    ReconcileError,
    ReconcileSummary,
    RowCounts,
    RunCounts,
    one_line,
    plan_outcome,
)
from lapse.operations.reconcile.kfp_rows import (
    count_finished_kfp_rows,
    database_problem,
    finished_kfp_rows,
    kfp_run,
)
from lapse.operations.reconcile.planner import build_planner
from lapse.runtime.resources import Resources
from lapse.runtime.trust import trust_of_own_read

SOURCE: Final = "/lapse/reconcile"
log = logging.getLogger(__name__)
# Run ids per `pipeline/runid in (...)` selector: about 2 KB of query string.
RUN_ID_CHUNK: Final = 50
LIST_CONCURRENCY: Final = 4
# Past this many failed plannings the cause is not one bad run (NATS is gone, or lapse
# lacks a permission): stop instead of failing every remaining run slowly.
MAX_ERRORS: Final = 50
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def namespace_matches(namespace: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(namespace, pattern)


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))


async def bounded(work: Iterable[Awaitable[None]], limit: int) -> None:
    """Await every item with at most `limit` in flight."""
    slots = asyncio.Semaphore(limit)

    async def one(item: Awaitable[None]) -> None:
        async with slots:
            await item

    await asyncio.gather(*(one(item) for item in work))


async def _pages(within: AsyncIterator[tuple[str | None, Page]]) -> AsyncIterator[Page]:
    async for _, page in within:
        yield page


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
        self.policies: tuple[Policy, ...] = tuple(planner.policies)
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

    async def reconcile_runs(self, counts: RunCounts | None = None) -> RunCounts:
        """Plan every finished run in scope, counted into `counts` (a new tally if None)."""
        counts = RunCounts() if counts is None else counts
        self.progress.start("runs", None)
        try:
            for kind in self.resources.config.kinds:
                if self.options.kinds and kind.name not in self.options.kinds:
                    continue
                await self._reconcile_kind(kind, counts)
        finally:
            self.progress.finish("runs")
        return counts

    async def _reconcile_kind(self, kind: KindSpec, counts: RunCounts) -> None:
        # A glob is listed one matching namespace at a time (lapse/edges/kubernetes/
        # namespaces.py), not as the whole kind filtered here.
        pages = _pages(
            finished_pages_within(
                self.resources.objects(),
                kind,
                self.options.namespace,
                page_size=self.options.page_size,
                label_selector=self.options.label_selector,
            )
        )
        try:
            async with aclosing(prefetched(pages)) as items:
                await self._plan_pages(kind, items, counts)
        except ApiException as exc:
            if exc.status == 404:  # the kind's CRD is not installed: nothing of it exists
                log.warning("%s is not served by this API server: skipped", kind.describe())
                return
            where = f" in {self.options.namespace}" if self.options.namespace else ""
            raise ReconcileError(
                f"listing finished {kind.describe()}{where} failed: {one_line(exc)}"
            ) from exc

    async def _plan_pages(
        self, kind: KindSpec, pages: AsyncIterator[list[dict[str, Any]]], counts: RunCounts
    ) -> None:
        async for items in pages:
            in_scope = [obj for obj in items if self._in_scope(obj)]
            await bounded(
                (self._plan(kind, obj, counts) for obj in in_scope), self.options.concurrency
            )
            self.progress.advance("runs", len(in_scope))
            if counts.errors > MAX_ERRORS:
                raise ReconcileError(
                    f"gave up after {counts.errors} runs could not be planned: {self.problems[0]}"
                )

    def _in_scope(self, obj: dict[str, Any]) -> bool:
        namespace = str(obj.get("metadata", {}).get("namespace", ""))
        within = self.options.within
        if within is not None and out_of_scope(namespace, within) is not None:
            return False
        return namespace_matches(namespace, self.options.namespace)

    async def _plan(self, kind: KindSpec, obj: dict[str, Any], counts: RunCounts) -> None:
        counts.listed += 1
        try:
            finished = adapt(obj, kind)
        except InvalidEvent:
            counts.ignored += 1
            return
        if not isinstance(finished, RunFinished):
            counts.ignored += 1
            return
        try:
            # Listed from the API server by this process: the planned version may be judged
            # by the reaper without another read (lapse/runtime/trust.py).
            emitted = await self.planner.handle(self._event(obj, finished), trust_of_own_read())
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
            # From the database's own records: no version lapse read from the API server.
            emitted = await self.planner.apply(run, decision, Provenance.CLAIMED)
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
            page = await list_metadata(
                self.resources.kube_client(),
                self.resources.kube_executor(),
                ARGO_WORKFLOW,
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
