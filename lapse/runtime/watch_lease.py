"""One watcher per kind among the `lapse up` processes sharing a NATS (`kubernetes.
watch_lease`): each kind's watch runs only in the process holding its lease.

Every round (a quarter of the TTL) the keeper says it is alive, renews the leases it
holds, stops the watch of any it lost (a CAS conflict) or could not renew for long enough
(lapse.runtime.lease_plan.must_give_up: before the lease can expire for the others),
hands over kinds beyond its share, and takes free kinds dealt to it. A watcher stopped on
hand-over stores its position first, so its successor resumes where it ended; one stopped
because NATS went away resumes from the last position it stored. Either way an event
published twice is one JetStream drops (its id is the object's uid and version) and one
the planner finds planned already: the lease saves the work of every process watching
everything, safety never depended on it.

On a clean stop the keeper releases its leases (another process takes over within a
round); killed, its leases expire one TTL after its last renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from lapse import telemetry
from lapse.edges.watch_leases import WatchLeases
from lapse.runtime.lease_plan import must_give_up, plan, round_interval
from lapse.runtime.outages import nats_unavailable
from lapse.runtime.supervisor import Retrying
from lapse.runtime.watcher import KindWatcher

log = logging.getLogger(__name__)

# How often, as a share of the TTL, held leases are checked for giving up.
GUARD_SHARE = 0.05


@dataclass
class _Holding:
    revision: int
    renewed: float  # monotonic: when the last acknowledged write of the lease was sent
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class LeaseKeeper:
    """Runs the watchers of the kinds this process holds the lease of."""

    def __init__(
        self,
        leases: WatchLeases,
        watchers: list[KindWatcher],
        *,
        clock: Callable[[], float] = time.monotonic,
        start: Callable[[str, Callable[[], Awaitable[None]]], asyncio.Task[None]] | None = None,
    ) -> None:
        """`start` runs a watcher as a task of its own name (`Supervisor.start_part`, so
        `lapse status` shows `watcher <kind>` as without leases); by default a sub-task."""
        self._leases = leases
        self._start_task = start or _sub_task
        self._watchers = {watcher.kind.name: watcher for watcher in watchers}
        self._kinds = [watcher.kind.name for watcher in watchers]
        self._clock = clock
        self.holding: dict[str, _Holding] = {}
        self._free_before: frozenset[str] = frozenset()

    def held(self) -> list[str]:
        return [kind for kind in self._kinds if kind in self.holding]

    async def run(self, stop: asyncio.Event) -> None:
        retrying = Retrying("watch leases")
        # Apart from the rounds: a renewal that hangs (NATS gone, a request waiting out its
        # timeout) must not hold a watch past the moment its lease may expire.
        guard = asyncio.create_task(self._guard(), name="watch lease guard")
        try:
            while not stop.is_set():
                try:
                    async with asyncio.timeout(self._leases.ttl):
                        await self._round()
                    retrying.succeeded()
                except Exception as exc:
                    if not isinstance(exc, TimeoutError) and nats_unavailable(exc) is None:
                        raise
                    log.debug("watch leases: %s", exc)
                    retrying.delay(exc)  # shown in `lapse status`; the round comes anyway
                self._raise_if_a_watcher_failed()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), round_interval(self._leases.ttl))
        finally:
            guard.cancel()
            await self._release_all()

    async def _guard(self) -> None:
        while True:
            self._give_up_expired()
            await asyncio.sleep(self._leases.ttl * GUARD_SHARE)

    async def _round(self) -> None:
        await self._leases.join()
        for kind, holding in list(self.holding.items()):
            sent = self._clock()
            revision = await self._leases.renew(kind, holding.revision)
            if revision is None:
                log.warning("%s: the watch lease was taken over: this process stops watching",
                            kind)  # fmt: skip
                await self._stop_watching(kind, store=False)
                continue
            holding.revision, holding.renewed = revision, sent
        members = await self._leases.members()
        leases = await self._leases.holders(self._kinds)
        holders = {kind: (lease.holder if lease else None) for kind, lease in leases.items()}
        for kind, lease in leases.items():
            # Still ours in the bucket, not watched here (the keeper restarted by its
            # supervisor, or a watch given up while NATS was slow): renewed, then watched.
            if lease is not None and lease.holder == self._leases.me and kind not in self.holding:
                sent = self._clock()
                revision = await self._leases.renew(kind, lease.revision)
                if revision is not None:
                    self._start(kind, revision, sent)
        moves = plan(self._leases.me, self._kinds, members, holders, self._free_before)
        self._free_before = frozenset(k for k, holder in holders.items() if holder is None)
        for kind in moves.release:
            handed = self.holding.get(kind)
            if handed is None:
                continue
            log.info("%s: handing the watch over (more processes share the kinds now)", kind)
            await self._stop_watching(kind, store=True)
            await self._leases.release(kind, handed.revision)
        for kind in moves.take:
            sent = self._clock()
            revision = await self._leases.take(kind)
            if revision is not None:
                log.info("%s: this process holds the watch lease now", kind)
                self._start(kind, revision, sent)
        telemetry.observe_watch_leases(self.held())

    def _start(self, kind: str, revision: int, renewed: float) -> None:
        holding = self.holding[kind] = _Holding(revision, renewed)
        watcher = self._watchers[kind]
        holding.task = self._start_task(f"watcher {kind}", partial(watcher.run, holding.stop))

    def _give_up_expired(self) -> None:
        now = self._clock()
        for kind, holding in list(self.holding.items()):
            if must_give_up(holding.renewed, now, self._leases.ttl):
                log.warning(
                    "%s: the watch lease could not be renewed for %.1fs: this process stops "
                    "watching before another can take it over", kind, now - holding.renewed,
                )  # fmt: skip
                holding.stop.set()
                if holding.task is not None:
                    holding.task.cancel()
                del self.holding[kind]

    def _raise_if_a_watcher_failed(self) -> None:
        """A watcher ends only when stopped or on a fatal error (401/403): say it here,
        where the supervisor sees it."""
        for holding in self.holding.values():
            task = holding.task
            if task is not None and task.done() and not task.cancelled():
                exc = task.exception()
                if exc is not None:
                    raise exc

    async def _stop_watching(self, kind: str, *, store: bool) -> None:
        holding = self.holding.pop(kind, None)
        if holding is None or holding.task is None:
            return
        holding.stop.set()
        if not store:
            holding.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await holding.task

    async def _release_all(self) -> None:
        held = list(self.holding.items())
        for kind, _ in held:
            await self._stop_watching(kind, store=True)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):  # stopping must not hang on a NATS away
                for kind, holding in held:
                    await self._leases.release(kind, holding.revision)
                await self._leases.leave()
        telemetry.observe_watch_leases([])


def _sub_task(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    async def part() -> None:
        await run()

    return asyncio.create_task(part(), name=name)
