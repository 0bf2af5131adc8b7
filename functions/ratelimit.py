"""How fast deletions may go: a token bucket, and a mass-deletion brake. Pure: no I/O, no
clock of their own (every method takes `now`, in seconds on any clock that does not jump
backwards by much), so they are tested without sleeping and shared by every reaper.

- `TokenBucket`: `rate` deletions per second with bursts up to `burst`. A reservation
  never fails: it says how long to wait (GCRA-style, tokens may go negative), so excess
  work is delayed in arrival order and never dropped.
- `MassDeletionBrake`: more than `max_count` deletions within `window` seconds trips it;
  deletion then pauses for one whole window (or until `acknowledge()`), and only the
  admission that trips it reports `tripped`, so the caller raises one alert per trip.

Both are per process. The reaper asks for them through two ports, `RateLimit` and `Brake`:
`LocalRateLimit` and `LocalBrake` wrap the classes here; lapse gives every reaper the ones
kept in NATS (lapse/edges/limits.py), so the limits hold for the whole deployment however
many processes run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lapse.functions.safety import SafetyConfig


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None, *, now: float = 0.0) -> None:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate must be a positive finite number, not {rate!r}")
        # One second's worth by default: the configured rate is also the largest burst.
        self.burst = float(burst) if burst is not None else max(1.0, float(rate))
        if self.burst < 1:
            raise ValueError(f"burst must be at least 1, not {burst!r}")
        self.rate = float(rate)
        self._tokens = self.burst
        self._last = now

    def _refill(self, now: float) -> None:
        # A clock stepping backwards adds nothing (and is not an error): the bucket waits
        # for the clock to pass the last reading again.
        elapsed = max(0.0, now - self._last)
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
        self._last = max(self._last, now)

    def delay(self, now: float) -> float:
        """Seconds until a token would be free, without taking one."""
        self._refill(now)
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self.rate

    def reserve(self, now: float) -> float:
        """Take a token; the seconds to wait before using it (0 when one is free now)."""
        wait = self.delay(now)
        self._tokens -= 1
        return wait


@dataclass(frozen=True, slots=True)
class BrakeDecision:
    """`admitted`: go ahead (counted). Otherwise paused until `until`; `tripped` is True only
    for the admission that engaged the brake."""

    admitted: bool
    until: float | None = None
    tripped: bool = False


ADMITTED = BrakeDecision(admitted=True)


class MassDeletionBrake:
    def __init__(self, max_count: int, window: float, *, enabled: bool = True) -> None:
        if max_count < 1:
            raise ValueError(f"max_count must be at least 1, not {max_count!r}")
        if not window > 0:
            raise ValueError(f"window must be positive, not {window!r}")
        self.max_count = max_count
        self.window = float(window)
        self.enabled = enabled
        # At most max_count timestamps: memory is bounded by the configuration.
        self._recent: deque[float] = deque(maxlen=max_count)
        self._paused_until: float | None = None

    @property
    def paused_until(self) -> float | None:
        return self._paused_until

    def admit(self, now: float) -> BrakeDecision:
        """Count one deletion at `now`, or refuse it while the brake is engaged."""
        if not self.enabled:
            return ADMITTED
        if self._paused_until is not None:
            if now < self._paused_until:
                return BrakeDecision(admitted=False, until=self._paused_until)
            self._paused_until = None
        while self._recent and self._recent[0] <= now - self.window:
            self._recent.popleft()
        if len(self._recent) >= self.max_count:
            # A fresh count after the pause: the deletions before it were already judged.
            self._recent.clear()
            self._paused_until = now + self.window
            return BrakeDecision(admitted=False, until=self._paused_until, tripped=True)
        self._recent.append(now)
        return ADMITTED

    def acknowledge(self) -> None:
        """An operator looked at the alert: release the pause now, with a fresh count."""
        self._paused_until = None
        self._recent.clear()


# --- shared by every reaper process -------------------------------------------------------
# The token bucket and the brake above hold for one process. A deployment with several
# reaper processes (Knative scales the object-reaper, `lapse up` may run twice) needs limits
# whose state lives outside any of them: the reaper asks these two ports, and lapse gives
# it either the in-process versions below or ones kept in NATS (lapse/edges/limits.py).


class RateLimit(Protocol):
    async def reserve(self, now: float) -> float:
        """Take a deletion slot; the seconds to wait before deleting (0: now)."""
        ...


class Brake(Protocol):
    async def admit(self, now: float) -> BrakeDecision:
        """Count one deletion at `now`, or refuse it while the brake is engaged."""
        ...


class LocalRateLimit:
    """`RateLimit` for one process: a `TokenBucket`."""

    def __init__(self, rate: float, *, now: float = 0.0) -> None:
        self.bucket = TokenBucket(rate, now=now)

    async def reserve(self, now: float) -> float:
        return self.bucket.reserve(now)


class LocalBrake:
    """`Brake` for one process: a `MassDeletionBrake`."""

    def __init__(self, brake: MassDeletionBrake) -> None:
        self.brake = brake

    async def admit(self, now: float) -> BrakeDecision:
        return self.brake.admit(now)


def local_limits(safety: SafetyConfig, now: float) -> tuple[RateLimit, Brake]:
    """This process's own rate limit and brake from the `safety:` settings: what a reaper
    uses when the runtime gives it none shared with the deployment (tests, one process)."""
    brake = safety.mass_deletion_brake
    return (
        LocalRateLimit(safety.max_deletions_per_second, now=now),
        LocalBrake(
            MassDeletionBrake(brake.max_due, brake.window.total_seconds(), enabled=brake.enabled)
        ),
    )
