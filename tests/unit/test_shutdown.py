"""A stopping process cancels again what swallowed its cancellation (lapse/runtime/shutdown.py).

The task that swallows is written here: the real one (nats-py's reconnect loop losing the
cancellation that lands as a connection attempt fails) is a race this test cannot provoke
on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import pytest

from lapse.runtime import shutdown


async def _swallows_once(started: asyncio.Event) -> None:
    started.set()
    with contextlib.suppress(asyncio.CancelledError):  # the lost cancellation
        await asyncio.sleep(3600)
    await asyncio.sleep(3600)


def test_asyncio_run_ends_when_a_task_swallows_its_cancellation() -> None:
    """The shape of the hang: the main coroutine returns, asyncio.run cancels what is left
    and waits for it; without the guard this run would never end."""

    async def main() -> None:
        started = asyncio.Event()
        asyncio.get_running_loop().create_task(_swallows_once(started), name="stubborn")
        await started.wait()
        shutdown.guard(asyncio.get_running_loop(), after=0.05)

    # In a thread of its own, so that a hang fails this test instead of holding the run.
    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(timeout=10)
    assert not runner.is_alive(), "asyncio.run still waiting on the stubborn task"


async def test_the_straggler_is_named_and_a_bystander_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    stubborn = loop.create_task(_swallows_once(started), name="stubborn")
    bystander = loop.create_task(asyncio.sleep(3600), name="bystander")
    await started.wait()
    stubborn.cancel()
    with caplog.at_level(logging.WARNING, logger=shutdown.__name__):
        shutdown.guard(loop, after=0.05)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stubborn, timeout=10)
    assert "stubborn: _swallows_once() test_shutdown.py:" in caplog.text
    assert "bystander" not in caplog.text
    assert not bystander.done()  # never cancelled, so never touched
    bystander.cancel()


async def test_nothing_is_reported_once_everything_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    quick = loop.create_task(asyncio.sleep(3600), name="quick")
    quick.cancel()
    fired = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger=shutdown.__name__):
        shutdown.guard(loop, after=0.05)
        loop.call_later(0.1, fired.set)  # after the guard's check
        await fired.wait()
    assert quick.cancelled()
    assert shutdown.stragglers(loop) == []
    assert "still running" not in caplog.text
