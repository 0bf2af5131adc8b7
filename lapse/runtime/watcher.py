"""The watcher: list + watch one configured kind, publish run.finished / run.deleted.
`lapse up` runs one per kind (`kinds:` in lapse.yaml).

Where the kind has a server-side selector for finished objects (Argo's `completed` label)
only those are listed and watched, so memory and traffic do not grow with running work.
Kinds without one (Tekton runs, Jobs, TrainJobs: the API server cannot select on status)
are listed and watched whole: an unfinished object is adapted to Ignored and dropped at
once, nothing is kept per object, and the watch delivers the update that finishes it; a
re-list happens only at start and after 410 Gone, never on a timer. A kind the API server
does not serve (its CRD not installed) is looked for again every minute.

A deletion this process's own reaper made is not reported (lapse.edges.kubernetes.
own_deletions): the deadline that caused it has fired, and the planner has nothing to
cancel. It resumes from the last resourceVersion (bookmarks keep it fresh) and re-lists on
410 Gone. Re-listing publishes every finished object again: the planner treats an unchanged
run as a no-op and the event ids (uid + resourceVersion) let JetStream drop exact
duplicates, so a restart loses no finish and does no harm by repeating one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException

from events.adapters.objects import adapt
from events.builder import build_event
from events.errors import InvalidEvent
from events.kinds import KindSpec
from events.models import CleanupFailed, RunDeleted, RunFinished
from events.types import EventType
from lapse.edges.kubernetes import KubeObjects, finished_pages
from lapse.edges.kubernetes.client import describe_api_error
from lapse.runtime.outages import Backoff, nats_unavailable

log = logging.getLogger(__name__)

SOURCE = "/lapse/watcher"
PAGE_SIZE = 500
# How often a kind whose CRD is not installed is looked for again.
NOT_SERVED_RETRY = 60.0

Publish = Callable[[BaseCloudEvent], Awaitable[None]]


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
    ) -> None:
        self._objects = objects
        self.kind = kind
        self._not_served_retry = not_served_retry
        self._publish = publish
        self._report = report
        self._watch_timeout = watch_timeout
        self.relists = 0
        self.synced = asyncio.Event()  # set once the first list has been published

    async def run(self, stop: asyncio.Event, *, resume_from: str | None = None) -> None:
        """Watch until `stop`. With `resume_from`, continue a watch from that version
        instead of listing first (a 410 Gone falls back to a list)."""
        # A quiet cluster sends nothing for minutes: stopping must not wait for an event.
        loop = asyncio.create_task(self._loop(stop, resume_from))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([loop, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when this task itself is cancelled: the inner loop owns a watch thread.
            stopped.cancel()
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    async def _loop(self, stop: asyncio.Event, resume_from: str | None) -> None:
        resource_version = resume_from or await self._relist_until_listed()
        backoff = 1.0
        while not stop.is_set():
            try:
                async for change in self._objects.watch(
                    self.kind,
                    resource_version=resource_version,
                    label_selector=self.kind.finished_selector,
                    timeout_seconds=self._watch_timeout,
                ):
                    resource_version = change.object["metadata"]["resourceVersion"]
                    if change.type != "BOOKMARK":
                        await self._handle(change.object, deleted=change.type == "DELETED")
                backoff = 1.0
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired (410 Gone): listing again")
                    resource_version = await self._relist_until_listed()
                    continue
                log.warning(
                    "watch failed (%s): retrying in %.0fs", describe_api_error(exc), backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as exc:
                log.warning(
                    "watch failed (%s): retrying in %.0fs", describe_api_error(exc), backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _relist_until_listed(self) -> str:
        """A failed list is retried (an API server restart must not end the watcher)."""
        backoff = 1.0
        what = self.kind.describe()
        while True:
            try:
                return await self._relist()
            except ApiException as exc:
                if exc.status != 404:
                    log.warning(
                        "listing %s failed (%s): retrying in %.0fs",
                        what,
                        describe_api_error(exc),
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
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
                log.warning(
                    "listing %s failed (%s): retrying in %.0fs",
                    what,
                    describe_api_error(exc),
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _relist(self) -> str:
        """Publish every finished object, page by page; return the list's version."""
        self.relists += 1
        version = ""
        async for page in finished_pages(self._objects, self.kind, page_size=PAGE_SIZE):
            for obj in page.items:
                await self._handle(obj, deleted=False)
            version = page.resource_version
        self.synced.set()
        return version

    async def _handle(self, obj: dict[str, Any], *, deleted: bool) -> None:
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
            return
        metadata = obj["metadata"]
        if isinstance(result, RunFinished):
            event_type = EventType.RUN_FINISHED
        elif isinstance(result, RunDeleted):
            if self._objects.own_deletions.take(result.run.uid):
                return  # this process's reaper deleted it: no deadline left to cancel
            event_type = EventType.RUN_DELETED
        else:
            return
        # Deterministic id: the same object version is the same event, which JetStream's
        # duplicate window drops when a re-list repeats it.
        event_id = f"{metadata['uid']}.{metadata.get('resourceVersion', '')}.{event_type.value}"
        await self._publish_until_stored(
            build_event(event_type, source=SOURCE, data=result, id=event_id)
        )

    async def _publish_until_stored(self, event: BaseCloudEvent) -> None:
        """NATS unavailable (a stream leader being elected, a restart) is waited out here,
        holding the watch where it is, rather than ending the watch and starting it over."""
        backoff = Backoff(first=0.2, cap=5.0)
        attempt = 0
        while True:
            try:
                await self._publish(event)
                return
            except Exception as exc:
                reason = nats_unavailable(exc)
                if reason is None:
                    raise
                attempt += 1
                delay = backoff.delay(attempt)
                log.info("%s: %s; publishing again in %.1fs", self.kind.name, reason, delay)
                await asyncio.sleep(delay)
