"""A process whose NATS is gone still ends: nats-py's reconnect loop can swallow a
cancellation, and a stopping process cancels it again (lapse/runtime/shutdown.py). Real
nats-py, a real nats-server, stopped."""

from __future__ import annotations

import asyncio
import random

import nats
from nats.aio.client import Client

from lapse.embedded.nats import EmbeddedNats
from lapse.runtime import shutdown
from tests.stack import wait_for

# A cancellation landing as a reconnect attempt fails is swallowed (the loop sleeps and
# tries again): about 1 in 100 on this machine, when they land at arbitrary moments. With
# this many clients, without the guard one loop or more almost always keeps running.
CLIENTS = 300


async def _quiet(exc: Exception) -> None:
    return None


async def test_reconnect_loops_that_swallowed_their_cancellation_are_cancelled_again(
    own_nats: EmbeddedNats,
) -> None:
    before = asyncio.all_tasks()
    # By name, as a Service is reached: each attempt resolves it on a thread first.
    url = own_nats.url.replace("127.0.0.1", "localhost")
    clients: list[Client] = [
        await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                           error_cb=_quiet)
        for _ in range(CLIENTS)
    ]  # fmt: skip
    own_nats.stop()

    async def reconnecting() -> bool:
        return all(c.is_reconnecting for c in clients)

    await wait_for(reconnecting, timeout=30)
    await asyncio.sleep(1.0)  # attempts spread over the back-off
    # What asyncio.run cancels when the process stops: every task the clients run. Each
    # once, at an arbitrary moment of its loop, as a pod's one client is.
    theirs = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
    assert theirs

    async def cancel_once(task: asyncio.Task[object]) -> None:
        await asyncio.sleep(random.uniform(0, 2))
        task.cancel()

    await asyncio.gather(*(cancel_once(t) for t in theirs))
    shutdown.guard(asyncio.get_running_loop(), after=0.5)

    async def ended() -> bool:
        return all(t.done() for t in theirs)

    await wait_for(ended, timeout=10, interval=0.1)
