"""How `lapse reconcile` shows its progress on stderr: a live bar per pass for a person at a
terminal (rich), one plain line every few seconds for a log (a CI job, a CronJob)."""

from __future__ import annotations

import time
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

PHASES = {"runs": "finished runs", "rows": "KFP run rows"}
# How often the plain progress lines appear when nobody watches a terminal (CI logs, a
# CronJob): often enough to show life, rarely enough to stay readable.
PLAIN_INTERVAL = 10.0


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f}/s" if speed else "", style="progress.data.speed")


class BarProgress:
    """A live bar per pass, for a person at a terminal."""

    def __init__(self, stream: IO[str]) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _Rate(),
            TimeElapsedColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> BarProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, phase: str, total: int | None) -> None:
        self._tasks[phase] = self._progress.add_task(PHASES.get(phase, phase), total=total)

    def advance(self, phase: str, count: int) -> None:
        self._progress.advance(self._tasks[phase], count)

    def finish(self, phase: str) -> None:
        task = self._tasks[phase]
        done = self._progress.tasks[task].completed
        # An unknown total becomes the final count, so the finished bar reads full.
        self._progress.update(task, total=done, completed=done)


class LineProgress:
    """One plain line every PLAIN_INTERVAL seconds and one per finished pass, for logs."""

    def __init__(self, stream: IO[str], interval: float = PLAIN_INTERVAL) -> None:
        self._stream = stream
        self._interval = interval
        self._done: dict[str, int] = {}
        self._total: dict[str, int | None] = {}
        self._started: dict[str, float] = {}
        self._last_line = 0.0

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self, phase: str, total: int | None) -> None:
        self._done[phase] = 0
        self._total[phase] = total
        self._started[phase] = self._last_line = time.monotonic()

    def advance(self, phase: str, count: int) -> None:
        self._done[phase] += count
        if time.monotonic() - self._last_line >= self._interval:
            self._line(phase, "")

    def finish(self, phase: str) -> None:
        self._line(phase, " done")

    def _line(self, phase: str, suffix: str) -> None:
        now = time.monotonic()
        self._last_line = now
        done, total = self._done[phase], self._total[phase]
        elapsed = now - self._started[phase]
        of = f"/{total:,}" if total is not None else ""
        rate = f", {done / elapsed:,.0f}/s" if elapsed > 0 else ""
        print(
            f"reconcile: {PHASES.get(phase, phase)}: {done:,}{of} in {elapsed:.1f}s{rate}{suffix}",
            file=self._stream,
            flush=True,
        )


def progress_for(stream: IO[str]) -> BarProgress | LineProgress:
    # Progress goes to stderr, so stdout stays clean for `-o json`: what matters is
    # whether someone watches stderr.
    return BarProgress(stream) if stream.isatty() else LineProgress(stream)
