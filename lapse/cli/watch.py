"""`--watch`: redraw a view in place until Ctrl-C, which ends it with exit code 0.

Tables are redrawn on a cleared screen (with a `watch`-style first line); json and yaml
print one document per change (json on one line), so a script can read them as a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import IO, TypeVar

CLEAR = "\x1b[H\x1b[2J"
T = TypeVar("T")


def add_watch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="keep the view on screen and redraw it every --interval until Ctrl-C",
    )
    parser.add_argument(
        "--interval",
        type=_seconds,
        default=2.0,
        metavar="SECONDS",
        help="how often --watch redraws",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.1 and 3600 seconds")
    return value


Frame = Callable[[IO[str]], Awaitable[None]]


async def _until(stop: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None as soon as `stop` is set (then `work` is cancelled).

    Ctrl-C sets `stop` rather than cancelling the watch: a cancellation that lands inside
    the NATS client while a frame is read can be swallowed there, and the loop would then
    draw on forever (seen with a large audit stream)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)  # a read in flight ends or is left behind
    return None


async def _frame(draw: Frame) -> str:
    buffer = io.StringIO()
    await draw(buffer)
    return buffer.getvalue()


async def watch(draw: Frame, args: argparse.Namespace, title: str, out: IO[str]) -> None:
    stop = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    previous: str | None = None
    while (frame := await _until(stop, _frame(draw))) is not None:
        if args.output in ("table", "wide"):
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            out.write(f"{CLEAR}Every {args.interval:g}s: {title}   {stamp}\n\n{frame}")
        elif frame != previous:
            out.write(frame if args.output == "json" else f"---\n{frame}")
        previous = frame
        out.flush()
        await _until(stop, asyncio.sleep(args.interval))


def run_watch(work: Callable[[], Awaitable[None]]) -> int:
    """Run the watch loop; Ctrl-C is how a watch ends, so it exits 0."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_quietly(work))
    sys.stdout.flush()
    return 0


async def _quietly(work: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await work()
