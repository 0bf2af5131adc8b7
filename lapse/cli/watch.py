"""`--watch`: redraw a view in place until Ctrl-C, which ends it with exit code 0.

Tables are redrawn on a cleared screen (with a `watch`-style first line); json and yaml
print one document per change (json on one line), so a script can read them as a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import IO

CLEAR = "\x1b[H\x1b[2J"


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


async def _frames(draw: Frame) -> AsyncIterator[str]:
    while True:
        buffer = io.StringIO()
        await draw(buffer)
        yield buffer.getvalue()


async def watch(draw: Frame, args: argparse.Namespace, title: str, out: IO[str]) -> None:
    previous: str | None = None
    async for frame in _frames(draw):
        if args.output in ("table", "wide"):
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            out.write(f"{CLEAR}Every {args.interval:g}s: {title}   {stamp}\n\n{frame}")
        elif frame != previous:
            out.write(frame if args.output == "json" else f"---\n{frame}")
        previous = frame
        out.flush()
        await asyncio.sleep(args.interval)


def run_watch(work: Callable[[], Awaitable[None]]) -> int:
    """Run the watch loop; Ctrl-C is how a watch ends, so it exits 0."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_quietly(work))
    sys.stdout.flush()
    return 0


async def _quietly(work: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await work()
