"""A stopping process names what keeps it from ending, and cancels that again.

When a process's main coroutine returns (func-python's server, `lapse up`), `asyncio.run`
cancels every task left and waits for all of them. A task that swallows its cancellation
keeps the process alive until the kubelet kills it at the end of the grace period (300 s
for the object-reaper: a Knative uninstall waited that long). nats-py's reconnect loop,
reconnecting to a NATS that is gone, swallows about one cancellation in a hundred and goes
on to its next attempt (measured with a real server: tests/integration/
test_shutdown_nats.py); cancelled again, it ends. So once a process is stopping, a task
that was cancelled and is still running a while later is logged with what it awaits, and
cancelled again, every `AFTER` seconds until none is left: a lost cancellation is
delivered by the next one, and one that is refused every time is at least named.

Only tasks already cancelled are touched, so arming this where the loop goes on (an
in-process test) cancels nothing that was not being cancelled already.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from types import CoroutineType, FrameType, GeneratorType
from typing import Any

log = logging.getLogger(__name__)

# Longer than an orderly close takes (NATS drained, then the database: 5 s each, see
# resources.CLOSE_TIMEOUT), far shorter than any grace period lapse's pods are given.
AFTER = 12.0


def guard(loop: asyncio.AbstractEventLoop, after: float = AFTER) -> None:
    """From now on, every `after` seconds while any is left: log the cancelled tasks that
    still run, and cancel them again."""
    loop.call_later(after, _check, loop, after)


def stragglers(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    """Tasks that were cancelled and have not ended."""
    return [t for t in asyncio.all_tasks(loop) if not t.done() and t.cancelling() > 0]


def _check(loop: asyncio.AbstractEventLoop, after: float) -> None:
    left = stragglers(loop)
    if not left:
        return
    log.warning(
        "stopping: %d task(s) still running %.0fs after being cancelled; cancelled again: %s",
        len(left), after, "; ".join(describe(t) for t in left),
    )  # fmt: skip
    for task in left:
        task.cancel()
    loop.call_later(after, _check, loop, after)


def describe(task: asyncio.Task[Any]) -> str:
    """`name: outer() file:line > ... > innermost() file:line`: where the task waits."""
    where = " > ".join(
        f"{frame.f_code.co_name}() {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        for frame in _awaiting(task.get_coro())
    )
    return f"{task.get_name()}: {where or 'not started'}"


def _awaiting(awaitable: object) -> Iterator[FrameType]:
    """The frames of a suspended coroutine and of the coroutines it awaits, outermost
    first."""
    seen = 0
    while awaitable is not None and seen < 64:
        seen += 1
        if isinstance(awaitable, CoroutineType):
            frame, awaitable = awaitable.cr_frame, awaitable.cr_await
        elif isinstance(awaitable, GeneratorType):
            frame, awaitable = awaitable.gi_frame, awaitable.gi_yieldfrom
        else:  # a future, or an async generator's step (which does not show its frame)
            return
        if frame is not None:
            yield frame
