"""One supervisor for every background task of `lapse up`: a dependency's outage never
ends the process.

Each task (a kind's watcher, the policy watcher, the dispatcher, the ingress, the health
and gauge reporters, whatever is added next) is started with `Supervisor.start`. A fault
is classified in one place (`lapse.runtime.faults.fault_of`):

- **transient** (the API server or NATS unreachable, a timeout, 408/429/5xx) and
  **unexpected** (a bug: logged with its traceback) are waited out: the loop that met it
  tries again after a capped exponential back-off with jitter (`Retrying`), and a task
  that ends on one is started again the same way. Neither ends the process.
- **fatal** (a configuration error, credentials or RBAC refused with 401/403) ends the
  process: retrying cannot change it, and an exit says so where a Deployment shows it.

While a task waits, what it waits out (why, since when, when it tries next) is kept in its
`TaskHealth`, which the pipeline reports to the health bucket (`lapse status`) and the
`lapse.outage.duration` gauge. A loop inside a task reports through `Retrying`, which finds
its task by context (a sub-task inherits it); outside a supervisor (the Knative path) it
logs the same and backs off the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lapse import telemetry
from lapse.runtime.faults import Fault, fault_of
from lapse.runtime.outages import Backoff

log = logging.getLogger(__name__)

# A task's loops retry a dependency within seconds at first, then once every 30 s.
TASK_BACKOFF = Backoff(first=1.0, cap=30.0, jitter=0.2)
# A task started again that runs this long without failing is running again.
STEADY_SECONDS = 10.0
RESTART = "restarted"


@dataclass(frozen=True)
class Wait:
    """One loop of a task waiting out a fault (times are wall-clock seconds)."""

    reason: str
    since: float
    next_try: float
    tries: int
    last: float  # when it last failed


class TaskHealth:
    """What one background task is waiting out now: per loop inside it (`part`)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self._clock = clock
        self._parts: dict[str, Wait] = {}

    def failed(self, part: str, fault: Fault, delay: float, tries: int) -> None:
        now = self._clock()
        held = self._parts.get(part)
        since = held.since if held is not None else now
        self._parts[part] = Wait(fault.reason, since, now + delay, tries, now)
        self._observe()

    def succeeded(self, part: str) -> float | None:
        """The loop `part` works again: how long it waited, or None if it was not."""
        held = self._parts.pop(part, None)
        if held is None:
            return None
        self._observe()
        return self._clock() - held.since

    def ended(self) -> None:
        """The task runs no more (a part stopped): nothing of it is waited out."""
        self._parts.clear()
        self._observe()

    def waiting(self) -> Wait | None:
        """The task's wait, when any loop of it waits: since the earliest, the latest
        reason, the next try soonest."""
        if not self._parts:
            return None
        waits = self._parts.values()
        latest = max(waits, key=lambda w: w.last)
        return Wait(
            latest.reason,
            min(w.since for w in waits),
            min(w.next_try for w in waits),
            max(w.tries for w in waits),
            latest.last,
        )

    def _observe(self) -> None:
        wait = self.waiting()
        telemetry.observe_waiting(self.name, 0, 0.0 if wait is None else self._clock() - wait.since)


_current: contextvars.ContextVar[TaskHealth | None] = contextvars.ContextVar(
    "lapse_supervised_task", default=None
)


class Retrying:
    """The retries of one loop inside a background task: `await wait_out(exc)` after a
    failure (raises it again when it is fatal), `succeeded()` once a try works."""

    def __init__(self, what: str, backoff: Backoff = TASK_BACKOFF) -> None:
        self.what = what
        self._backoff = backoff
        self._task = _current.get()
        self.tries = 0

    def delay(self, exc: BaseException) -> float:
        """Record the failure `exc` and return how long to wait; raise it if it is fatal."""
        fault = fault_of(exc)
        if fault.fatal:
            raise exc
        self.tries += 1
        delay = self._backoff.delay(self.tries, fault.retry_after)
        name = f"{self._task.name}: " if self._task is not None else ""
        if fault.unexpected:
            log.error("%s%s failed unexpectedly; next try in %.0fs", name, self.what, delay,
                      exc_info=exc)  # fmt: skip
        elif self.tries == 1:
            log.warning("%s%s: waiting: %s; next try in %.0fs",
                        name, self.what, fault.reason, delay)  # fmt: skip
        else:
            log.info("%s%s: still waiting (try %d): %s; next try in %.0fs",
                     name, self.what, self.tries, fault.reason, delay)  # fmt: skip
        if self._task is not None:
            self._task.failed(self.what, fault, delay, self.tries)
        return delay

    async def wait_out(self, exc: BaseException) -> None:
        await asyncio.sleep(self.delay(exc))

    def succeeded(self) -> None:
        if self.tries == 0:
            return
        self.tries = 0
        waited = self._task.succeeded(self.what) if self._task is not None else None
        name = f"{self._task.name}: " if self._task is not None else ""
        if waited is not None:
            log.warning("%s%s: recovered after %.0fs", name, self.what, waited)
        else:
            log.info("%s%s: recovered", name, self.what)


class Supervisor:
    """Runs background tasks until `stop`, starting again a task that fails transiently;
    `fatal` is the first fatal failure (the process ends with it)."""

    def __init__(self, stop: asyncio.Event, *, backoff: Backoff = TASK_BACKOFF) -> None:
        self._stop = stop
        self._backoff = backoff
        self.tasks: dict[str, TaskHealth] = {}
        self.fatal: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._running: list[asyncio.Task[None]] = []

    def start(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run `run()` as the task `name`, under supervision; its loops' `Retrying` report
        to it. A name is one task: starting it twice is a bug."""
        assert name not in self.tasks, f"{name} is supervised already"
        health = self.tasks[name] = TaskHealth(name)
        context = contextvars.copy_context()
        context.run(_current.set, health)
        task = asyncio.create_task(self._supervise(run), name=name, context=context)
        self._running.append(task)
        return task

    def start_part(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run `run()` as a part a supervised task starts and stops itself (a kind's watcher
        under its lease), shown as the task `name` while it runs: what it waits out is
        its own in `lapse status`, not its starter's. Its starter handles how it ends."""
        health = self.tasks[name] = TaskHealth(name)
        context = contextvars.copy_context()
        context.run(_current.set, health)

        async def part() -> None:
            try:
                await run()
            finally:
                if self.tasks.get(name) is health:
                    del self.tasks[name]
                    health.ended()

        return asyncio.create_task(part(), name=name, context=context)

    def running(self) -> list[asyncio.Task[None]]:
        """Every supervised task not ended yet."""
        return [t for t in self._running if not t.done()]

    def waiting(self) -> dict[str, Wait]:
        """Task name -> its wait, for every task waiting out a fault now."""
        return {name: w for name, h in self.tasks.items() if (w := h.waiting()) is not None}

    async def _supervise(self, run: Callable[[], Awaitable[None]]) -> None:
        restarts = Retrying(RESTART, self._backoff)
        loop = asyncio.get_running_loop()
        while True:
            steady = loop.call_later(STEADY_SECONDS, restarts.succeeded) if restarts.tries else None
            try:
                await run()
                return  # ended by `stop` (or with nothing left to do)
            except Exception as exc:
                fault = fault_of(exc)
                name = asyncio.current_task().get_name()  # type: ignore[union-attr]
                if fault.fatal:
                    log.error("%s: %s: lapse stops (retrying cannot change it)", name,
                              fault.reason)  # fmt: skip
                    if not self.fatal.done():
                        self.fatal.set_result(exc)
                    return
                if self._stop.is_set():
                    return  # failed on the way out: nothing to start again
                delay = restarts.delay(exc)
            finally:
                if steady is not None:
                    steady.cancel()
            await _sleep_unless(self._stop, delay)
            if self._stop.is_set():
                return

    async def until_stopped(self) -> BaseException | None:
        """Wait for `stop` or a fatal failure of a supervised task; return that failure."""
        stopped = asyncio.create_task(self._stop.wait(), name="stop")
        waits: list[asyncio.Future[Any]] = [stopped, self.fatal]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        return self.fatal.result() if self.fatal.done() else None


async def drain(tasks: list[asyncio.Task[Any]], grace: float) -> None:
    """Let `tasks` (what finishes its in-flight work when stopped) end within `grace`
    seconds; then cancel what is still busy."""
    _, busy = await asyncio.wait(tasks, timeout=grace)
    if busy:
        # Never hang on exit: what is cut short was not acknowledged, so JetStream delivers
        # it again to the next process that runs.
        names = ", ".join(sorted(t.get_name() for t in busy))
        log.warning("still busy %.0fs after stop (%s): cancelling", grace, names)
        for task in busy:
            task.cancel()
        await asyncio.wait(busy, timeout=5)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
