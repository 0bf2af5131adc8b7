"""The watcher: list + watch one configured kind, publish run.finished / run.deleted.
`lapse up` runs one per kind (`kinds:` in lapse.yaml).

Where the kind has a server-side selector for finished objects (Argo's `completed` label)
only those are listed and watched, so memory and traffic do not grow with running work.
Kinds without one (Tekton runs, Jobs, TrainJobs: the API server cannot select on status)
are listed and watched whole: an unfinished object is adapted to Ignored and dropped at
once, nothing is kept per object, and the watch delivers the update that finishes it; a
re-list happens only with no stored position (a first start) and after 410 Gone, never
on a timer. A kind the API server does not serve (its CRD not installed) is looked for
again every minute.

A deletion this process's own reaper made is not reported (lapse.edges.kubernetes.
own_deletions): the deadline that caused it has fired, and the planner has nothing to
cancel.

Restarts cost nothing (docs/architecture.md, "Restarts"): the watch resumes from the
position stored in `LAPSE_WATCH` (lapse.edges.watch_positions), advanced only past events
NATS acknowledged and never during a re-list; bookmarks keep it fresh on a quiet cluster.
A list happens only when nothing is stored or the API server answers 410 Gone, and then:
- the watch starts at once from the list's resourceVersion, and its (live) events are
  published as they come while the list's pages are published beside it, on the re-list
  lane (`lapse.events.relist.<type>`, its own durable consumer): a live finish never
  queues behind a re-list;
- a listed run that finished in the last RECENT_FINISH seconds before the list (while
  lapse was restarting) is news, not a repeat: it goes on the live lane too, so it is not
  planned after everything the list repeats (a list comes in name order, and a new run's
  name may sort after every old one's);
- an object whose resourceVersion is not newer than the stored position is not published
  again (its finish is in NATS already), nor is one the live watch has reported since the
  list (the live event is newer);
- what is published again the planner treats as a no-op when its schedules stand, and the
  event ids (uid + resourceVersion) let JetStream drop exact duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext

from lapse.edges import health
from lapse.edges.kubernetes import KubeObjects, Page, finished_pages
from lapse.edges.kubernetes.client import describe_api_error
from lapse.events.adapters.objects import adapt
from lapse.events.builder import build_event
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import KindSpec
from lapse.events.models import CleanupFailed, RunDeleted, RunFinished
from lapse.events.types import EventType
from lapse.runtime.outages import Backoff, nats_unavailable
from lapse.runtime.supervisor import Retrying

log = logging.getLogger(__name__)

SOURCE = "/lapse/watcher"
PAGE_SIZE = 500
# How often a kind whose CRD is not installed is looked for again.
NOT_SERVED_RETRY = 60.0

# The stored position is written at most this often while events flow (and on every
# bookmark after that): a crash repeats at most this much, as duplicates JetStream drops.
POSITION_INTERVAL = 1.0
# How many of a re-list's events are published at once, their acks awaited together.
RELIST_WINDOW = 64
# How often a running re-list's progress is written for `lapse status`.
PROGRESS_INTERVAL = 2.0
# A listed run that finished this long before the list began, or later, finished while
# lapse was (re)starting: its event goes on the live lane. Longer than a rolling restart
# takes; far shorter than any TTL worth a schedule.
RECENT_FINISH = timedelta(seconds=60)

# A stream leader's election takes seconds: NATS is tried again soon, the watch held.
NATS_BACKOFF = Backoff(first=0.2, cap=5.0)

Publish = Callable[[BaseCloudEvent], Awaitable[None]]
T = TypeVar("T")


class Positions(Protocol):
    """Where watch positions are kept (lapse.edges.watch_positions.WatchPositions)."""

    async def get(self, kind: str, cluster: str) -> str | None: ...

    async def put(self, kind: str, cluster: str, resource_version: str) -> None: ...


@dataclass
class Relist:
    """How far a running re-list is."""

    started: float = field(default_factory=time.monotonic)
    # Runs finished at or after this go on the live lane (RECENT_FINISH).
    recent_since: datetime = field(default_factory=lambda: datetime.now(UTC) - RECENT_FINISH)
    listed: int = 0  # objects read from the API server
    published: int = 0  # published on the re-list lane
    live: int = 0  # finished recently: published on the live lane
    skipped: int = 0  # not newer than the stored position, or reported live meanwhile

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


class KindWatcher:
    def __init__(
        self,
        objects: KubeObjects,
        kind: KindSpec,
        publish: Publish,
        report: Publish,
        *,
        watch_timeout: int = 300,
        not_served_retry: float = NOT_SERVED_RETRY,
        positions: Positions | None = None,
        publish_relist: Publish | None = None,
        position_interval: float = POSITION_INTERVAL,
    ) -> None:
        self._objects = objects
        self.kind = kind
        self._not_served_retry = not_served_retry
        self._publish = publish
        # Without a lane of its own (tests, a caller with one consumer) a re-list publishes
        # where live events go.
        self._publish_relist = publish_relist or publish
        self._report = report
        self._watch_timeout = watch_timeout
        self._positions = positions
        self._position_interval = position_interval
        self.relists = 0
        self.resumes = 0  # watches started from a stored position, without a list
        self.synced = asyncio.Event()  # set once the first list has been published
        self.relist: Relist | None = None  # while a re-list is being published
        # The position stored (or resumed from): every event up to it is in NATS.
        self._stored: str | None = None
        self._stored_at = 0.0
        # The version up to which the watch's events are published (acknowledged).
        self._watched: str | None = None
        # Uids the live watch reported while a re-list runs: their listed version is older.
        self._live_uids: set[str] = set()
        self._relisting: asyncio.Task[None] | None = None
        # A re-list that failed (other than NATS unavailable, which it waits out) ends the
        # watcher as a failed watch loop would: never a silently missing list.
        self._relist_failed: asyncio.Future[None] | None = None
        self._api = Retrying(f"watching {kind.describe()}")
        self._nats = Retrying("publishing to NATS", NATS_BACKOFF)

    async def run(self, stop: asyncio.Event, *, resume_from: str | None = None) -> None:
        """Watch until `stop`. With `resume_from` (or a stored position), continue a watch
        from that version instead of listing first (a 410 Gone falls back to a list)."""
        # Made here, in the task that runs the watcher: it reports to that task's supervisor.
        self._api = Retrying(f"watching {self.kind.describe()}")
        # One for every call to NATS, concurrent ones too: one warning when it goes away.
        self._nats = Retrying("publishing to NATS", NATS_BACKOFF)
        # A quiet cluster sends nothing for minutes: stopping must not wait for an event.
        self._relist_failed = asyncio.get_running_loop().create_future()
        loop = asyncio.create_task(self._loop(stop, resume_from))
        stopped = asyncio.create_task(stop.wait())
        try:
            waits: list[asyncio.Future[Any]] = [loop, stopped, self._relist_failed]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self._relist_failed.done():
                self._relist_failed.result()  # raises what the re-list failed with
        finally:
            # Also when this task itself is cancelled: the inner loop owns a watch thread.
            stopped.cancel()
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await self._cancel_relist()
            await self._store_final()

    async def _loop(self, stop: asyncio.Event, resume_from: str | None) -> None:
        stored = resume_from
        if stored is None and self._positions is not None:
            stored = await self._until_nats("reading the watch position", self._read_position)
        self._stored = stored
        if stored:
            self.resumes += 1
            log.info("%s: resuming the watch from resourceVersion %s", self.kind.name, stored)
            resource_version = stored
            self.synced.set()  # nothing to list: what is stored is published
        else:
            resource_version = await self._start_relist("nothing stored to resume from")
        self._watched = resource_version
        while not stop.is_set():
            try:
                async for change in self._objects.watch(
                    self.kind,
                    resource_version=resource_version,
                    label_selector=self.kind.finished_selector,
                    timeout_seconds=self._watch_timeout,
                ):
                    self._api.succeeded()  # the API server answers again
                    metadata = change.object["metadata"]
                    resource_version = metadata["resourceVersion"]
                    if change.type != "BOOKMARK":
                        if self.relist is not None:
                            self._live_uids.add(str(metadata.get("uid", "")))
                        await self._handle(change.object, deleted=change.type == "DELETED")
                    await self._advance(resource_version)
                self._api.succeeded()  # the watch ran to its timeout
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = await self._start_relist("the watch expired (410 Gone)")
                    self._watched = resource_version
                    continue
                if _too_large(exc):
                    # A version this API server never issued (its etcd restored from a
                    # backup): nothing of it can be compared to this server's objects.
                    self._stored = None
                    resource_version = await self._start_relist(
                        "the stored resourceVersion is newer than the API server's"
                    )
                    self._watched = resource_version
                    continue
                await self._api.wait_out(exc)
            except Exception as exc:
                # The API server away, 429/5xx, a bug: tried again, shown in `lapse
                # status`; a fatal answer (401/403) ends the watcher, and its supervisor
                # ends lapse with it.
                await self._api.wait_out(exc)

    # -- the stored position ------------------------------------------------------------

    async def _read_position(self) -> str | None:
        assert self._positions is not None
        return await self._positions.get(self.kind.name, self._objects.cluster)

    async def _advance(self, resource_version: str) -> None:
        """Everything up to `resource_version` is published: store it, now and then, but
        never while a re-list is still publishing the list it started from."""
        self._watched = resource_version
        if self._positions is None or self.relist is not None:
            return
        if time.monotonic() - self._stored_at < self._position_interval:
            return
        await self._store(resource_version)

    async def _store(self, resource_version: str) -> None:
        if self._positions is None or resource_version == self._stored:
            return
        self._stored_at = time.monotonic()
        try:
            await self._positions.put(self.kind.name, self._objects.cluster, resource_version)
            self._stored = resource_version
        except Exception as exc:  # NATS unavailable: an older position only repeats events
            log.debug("%s: storing the watch position failed: %s", self.kind.name, exc)

    async def _store_final(self) -> None:
        """On the way out, store how far the watch got (bounded: stopping must not hang)."""
        if self._watched is None or self.relist is not None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._store(self._watched), timeout=2.0)

    # -- the re-list ----------------------------------------------------------------------

    async def _start_relist(self, why: str) -> str:
        """List again: read the first page, start publishing the list beside the watch, and
        return the list's resourceVersion for the watch to start from."""
        await self._cancel_relist()
        first, pages = await self._first_page_until_listed()
        self._live_uids = set()
        progress = self.relist = Relist()
        log.info(
            "%s: listing every %s again (%s); the watch goes on meanwhile",
            self.kind.name, self.kind.describe(), why,
        )  # fmt: skip
        self._relisting = asyncio.create_task(
            self._publish_list(first, pages, progress), name=f"relist {self.kind.name}"
        )
        self._relisting.add_done_callback(self._relist_ended)
        return first.resource_version

    def _relist_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if self._relist_failed is not None and not self._relist_failed.done():
            self._relist_failed.set_exception(exc)

    async def _cancel_relist(self) -> None:
        task, self._relisting = self._relisting, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _publish_list(self, page: Page, pages: AsyncIterator[Page], progress: Relist) -> None:
        since = self._stored
        while True:
            # The next page is read while this one is published (two pages held at most):
            # the list's end, where a new run may sort, is reached sooner.
            following = asyncio.ensure_future(anext(pages))
            try:
                await self._publish_page(page, since, progress)
            except BaseException:
                following.cancel()
                with contextlib.suppress(BaseException):
                    await following
                raise
            try:
                page = await following
            except StopAsyncIteration:
                break
            except Exception as exc:
                # A page failed (the API server restarting): list from the start again. What
                # is published already is dropped as a duplicate or found unchanged.
                log.warning(
                    "%s: listing failed mid-way (%s): listing again",
                    self.kind.name, describe_api_error(exc),
                )  # fmt: skip
                page, pages = await self._first_page_until_listed()
        self.relist = None
        self._live_uids = set()
        self.synced.set()
        log.info(
            "%s: re-list done: %d objects in %.1fs, %d published, %d of them finished "
            "recently (on the live lane), %d unchanged since the stored position or "
            "reported live",
            self.kind.name, progress.listed, progress.seconds, progress.published + progress.live,
            progress.live, progress.skipped,
        )  # fmt: skip
        # The list and every watch event up to here are stored: the position may advance.
        if self._watched is not None:
            await self._store(self._watched)

    async def _publish_page(self, page: Page, since: str | None, progress: Relist) -> None:
        """A listed page's events: news on the live lane, repeats on the re-list lane."""
        window: list[BaseCloudEvent] = []
        for obj in page.items:
            progress.listed += 1
            metadata = obj.get("metadata", {})
            if _not_newer(metadata.get("resourceVersion"), since) or (
                metadata.get("uid") in self._live_uids
            ):
                progress.skipped += 1
                continue
            found = await self._event_of(obj, deleted=False)
            if found is None:
                continue
            event, result = found
            if _finished_since(result, progress.recent_since):
                await self._until_nats("publishing", functools.partial(self._publish, event))
                progress.live += 1
                continue
            window.append(event)
            if len(window) >= RELIST_WINDOW:
                progress.published += await self._publish_window(window)
                window = []
        if window:
            progress.published += await self._publish_window(window)

    async def _first_page_until_listed(self) -> tuple[Page, AsyncIterator[Page]]:
        """A failed list is retried (an API server restart must not end the watcher)."""
        what = self.kind.describe()
        while True:
            pages = finished_pages(self._objects, self.kind, page_size=PAGE_SIZE)
            self.relists += 1  # lists begun (a kind not served is looked for by listing)
            try:
                first = await anext(pages)
                self._api.succeeded()
                return first, pages
            except ApiException as exc:
                if exc.status != 404:
                    await self._api.wait_out(exc)
                    continue
                self._api.succeeded()  # answered: the kind is not served
                if not self.synced.is_set():
                    log.warning(
                        "%s is not served by this API server (its CRD is not installed?): "
                        "looking again every %.0fs",
                        what,
                        self._not_served_retry,
                    )
                    self.synced.set()  # nothing of it exists: nothing to wait for
                await asyncio.sleep(self._not_served_retry)
            except Exception as exc:
                await self._api.wait_out(exc)

    async def _publish_window(self, events: list[BaseCloudEvent]) -> int:
        """Publish a window of the re-list's events at once, their acks awaited together:
        one round trip's wait for the window instead of one each (a JetStream publish
        awaited alone costs the event loop a wake-up per event). Nothing in a re-list
        depends on the order of its objects, and the position is not stored until the
        whole list is published, so a failure part-way repeats only duplicates."""
        results = await asyncio.gather(
            *(self._until_nats("publishing", functools.partial(self._publish_relist, event))
              for event in events),
            return_exceptions=True,
        )  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return len(events)

    async def _handle(self, obj: dict[str, Any], *, deleted: bool) -> bool:
        """Publish what the watch reported of `obj`, if anything, on the live lane; whether
        an event was published."""
        found = await self._event_of(obj, deleted=deleted)
        if found is None:
            return False
        event, _ = found
        await self._until_nats("publishing", lambda: self._publish(event))
        return True

    async def _event_of(
        self, obj: dict[str, Any], *, deleted: bool
    ) -> tuple[BaseCloudEvent, RunFinished | RunDeleted] | None:
        """The event `obj` means, if any, and what it carries (an invalid object is
        reported instead)."""
        try:
            result = adapt(obj, self.kind, deleted)
        except InvalidEvent as exc:
            await self._report(
                build_event(
                    EventType.CLEANUP_FAILED,
                    source=SOURCE,
                    data=CleanupFailed(reason=exc.reason, stage="watcher"),
                )
            )
            return None
        metadata = obj["metadata"]
        if isinstance(result, RunFinished):
            event_type = EventType.RUN_FINISHED
        elif isinstance(result, RunDeleted):
            if self._objects.own_deletions.take(result.run.uid):
                return None  # this process's reaper deleted it: no deadline left to cancel
            event_type = EventType.RUN_DELETED
        else:
            return None
        # Deterministic id: the same object version is the same event, which JetStream's
        # duplicate window drops when a re-list repeats it.
        event_id = f"{metadata['uid']}.{metadata.get('resourceVersion', '')}.{event_type.value}"
        return build_event(event_type, source=SOURCE, data=result, id=event_id), result

    async def _until_nats(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """NATS unavailable (a stream leader being elected, a restart) is waited out here,
        holding the watch where it is, rather than ending the watch and starting it over."""
        while True:
            try:
                result = await call()
                self._nats.succeeded()
                return result
            except Exception as exc:
                if nats_unavailable(exc) is None:
                    raise
                log.debug("%s: %s failed: %s", self.kind.name, what, exc)
                await self._nats.wait_out(exc)


def _too_large(exc: ApiException) -> bool:
    """The API server's answer to a watch from a resourceVersion it has not reached."""
    return exc.status == 504 and "Too large resource version" in str(exc.reason or "")


def _finished_since(result: RunFinished | RunDeleted, since: datetime) -> bool:
    """Whether `result` is a run that finished at or after `since` (RECENT_FINISH)."""
    finished = result.run.finished_at if isinstance(result, RunFinished) else None
    return finished is not None and finished >= since


def _not_newer(resource_version: object, since: str | None) -> bool:
    """Whether an object's version is not newer than the stored position. resourceVersions
    are opaque by contract, but every API server lapse supports serves etcd revisions (the
    watch cache compares them the same way); anything else is never skipped."""
    if since is None or not isinstance(resource_version, str):
        return False
    try:
        return int(resource_version) <= int(since)
    except ValueError:
        return False


async def report_relists(
    js: JetStreamContext, watchers: Sequence[KindWatcher], *, replicas: int = 1
) -> None:
    """While a watcher re-lists, say how far it is where `lapse status` looks
    (LAPSE_HEALTH, key `relist.<process>.<kind>`); remove the key when it is over."""
    process = health.process_key()
    reported: set[str] = set()
    kv = None
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL)
        try:
            kv = kv or await health.bucket(js, replicas=replicas)
            for watcher in watchers:
                name, relist = watcher.kind.name, watcher.relist
                if relist is not None:
                    await health.report_relist(
                        kv,
                        health.Relisting(
                            process, name, relist.listed, relist.published, relist.seconds
                        ),
                    )
                    reported.add(name)
                elif name in reported:
                    await health.relist_over(kv, process, name)
                    reported.discard(name)
        except Exception as exc:  # NATS reconnecting: the next round tries again
            log.debug("re-list progress report failed: %s", exc)
