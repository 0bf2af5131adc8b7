"""The Argo watcher: list + watch finished Workflows, publish run.finished / run.deleted.

Only finished workflows are watched (server-side label selection on Argo's `completed`
label), so memory and traffic do not grow with running work. It resumes from the last
resourceVersion (bookmarks keep it fresh) and re-lists on 410 Gone. Re-listing publishes
every finished workflow again: the planner treats an unchanged run as a no-op and the
event ids (uid + resourceVersion) let JetStream drop exact duplicates, so a restart loses
no finish and does no harm by repeating one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException

from events.adapters import adapt_workflow
from events.adapters.argo import COMPLETED_SELECTOR
from events.builder import build_event
from events.errors import InvalidEvent
from events.models import CleanupFailed, RunDeleted, RunFinished
from events.types import EventType
from lapse.edges.kubernetes import Workflows, finished_workflow_pages

log = logging.getLogger(__name__)

SOURCE = "/lapse/watcher"
PAGE_SIZE = 500

Publish = Callable[[BaseCloudEvent], Awaitable[None]]


class WorkflowWatcher:
    def __init__(
        self,
        workflows: Workflows,
        publish: Publish,
        report: Publish,
        *,
        watch_timeout: int = 300,
    ) -> None:
        self._workflows = workflows
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
                async for change in self._workflows.watch(
                    resource_version=resource_version,
                    label_selector=COMPLETED_SELECTOR,
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
                log.warning("watch failed (%s): retrying in %.0fs", exc.status, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as exc:
                log.warning("watch failed (%s): retrying in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _relist_until_listed(self) -> str:
        """A failed list is retried (an API server restart must not end the watcher)."""
        backoff = 1.0
        while True:
            try:
                return await self._relist()
            except Exception as exc:
                log.warning("listing workflows failed (%s): retrying in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _relist(self) -> str:
        """Publish every finished workflow, page by page; return the list's version."""
        self.relists += 1
        version = ""
        async for page in finished_workflow_pages(self._workflows, page_size=PAGE_SIZE):
            for obj in page.items:
                await self._handle(obj, deleted=False)
            version = page.resource_version
        self.synced.set()
        return version

    async def _handle(self, obj: dict[str, Any], *, deleted: bool) -> None:
        try:
            result = adapt_workflow(obj, deleted)
        except InvalidEvent as exc:
            await self._report(
                build_event(
                    EventType.CLEANUP_FAILED,
                    source=SOURCE,
                    data=CleanupFailed(reason=exc.reason, stage="watcher"),
                )
            )
            return
        if isinstance(result, RunFinished):
            event_type = EventType.RUN_FINISHED
        elif isinstance(result, RunDeleted):
            event_type = EventType.RUN_DELETED
        else:
            return
        metadata = obj["metadata"]
        # Deterministic id: the same object version is the same event, which JetStream's
        # duplicate window drops when a re-list repeats it.
        event_id = f"{metadata['uid']}.{metadata.get('resourceVersion', '')}.{event_type.value}"
        await self._publish(build_event(event_type, source=SOURCE, data=result, id=event_id))
