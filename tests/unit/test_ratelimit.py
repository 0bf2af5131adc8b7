"""The token bucket and the mass-deletion brake, driven by an explicit clock (no sleeping)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.functions.ratelimit import MassDeletionBrake, TokenBucket

# Non-decreasing arrival times: cumulative sums of non-negative gaps.
gaps = st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), min_size=1, max_size=200)


def arrivals(steps: list[float]) -> list[float]:
    return list(itertools.accumulate(steps))


def test_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=2, burst=2)
    assert [bucket.reserve(0.0) for _ in range(5)] == [0.0, 0.0, 0.5, 1.0, 1.5]


def test_default_burst_is_one_seconds_worth_and_at_least_one() -> None:
    assert TokenBucket(rate=50).burst == 50
    slow = TokenBucket(rate=0.5)
    assert slow.burst == 1
    assert [slow.reserve(0.0), slow.reserve(0.0)] == [0.0, 2.0]


def test_idle_time_refills_only_up_to_the_burst() -> None:
    bucket = TokenBucket(rate=1, burst=3)
    for _ in range(3):
        bucket.reserve(0.0)
    waits = [bucket.reserve(1000.0) for _ in range(4)]
    assert waits == [0.0, 0.0, 0.0, 1.0]


def test_delay_peeks_without_taking() -> None:
    bucket = TokenBucket(rate=1, burst=1)
    assert bucket.delay(0.0) == 0.0
    assert bucket.delay(0.0) == 0.0
    bucket.reserve(0.0)
    assert bucket.delay(0.25) == pytest.approx(0.75)
    assert bucket.reserve(0.25) == pytest.approx(0.75)


def test_a_clock_stepping_back_mints_no_tokens() -> None:
    bucket = TokenBucket(rate=1, burst=1, now=100.0)
    assert bucket.reserve(100.0) == 0.0
    # 50 s "earlier" must not look like 50 s of refill, nor break the bucket.
    assert bucket.reserve(50.0) == pytest.approx(1.0)
    assert bucket.reserve(102.0) == pytest.approx(0.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, None), (-1, None), (float("inf"), None), (1, 0.5)])
def test_nonsense_settings_are_refused(rate: float, burst: float | None) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=rate, burst=burst)


@settings(max_examples=300)
@given(
    steps=gaps,
    rate=st.floats(min_value=0.1, max_value=100),
    burst=st.integers(min_value=1, max_value=20),
)
def test_releases_never_exceed_the_rate_and_keep_arrival_order(
    steps: list[float], rate: float, burst: int
) -> None:
    bucket = TokenBucket(rate=rate, burst=burst)
    times = arrivals(steps)
    releases = [t + bucket.reserve(t) for t in times]  # every request gets a slot: none dropped
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(releases))
    for i, j in itertools.combinations(range(len(releases)), 2):
        span = releases[j] - releases[i]
        assert j - i + 1 <= burst + rate * span + 1e-6


def test_brake_trips_on_the_first_deletion_over_the_limit() -> None:
    brake = MassDeletionBrake(max_count=3, window=60)
    assert [brake.admit(t).admitted for t in (0.0, 1.0, 2.0)] == [True, True, True]
    tripped = brake.admit(3.0)
    assert (tripped.admitted, tripped.tripped, tripped.until) == (False, True, 63.0)
    # Still paused: refused, but the alert was already raised once.
    later = brake.admit(30.0)
    assert (later.admitted, later.tripped, later.until) == (False, False, 63.0)
    assert brake.paused_until == 63.0


def test_brake_releases_after_one_window_with_a_fresh_count() -> None:
    brake = MassDeletionBrake(max_count=2, window=10)
    for t in (0.0, 0.0):
        brake.admit(t)
    assert brake.admit(1.0).tripped
    assert not brake.admit(10.99).admitted
    assert [brake.admit(11.0).admitted, brake.admit(11.0).admitted] == [True, True]
    assert brake.admit(11.0).tripped


def test_deletions_spread_wider_than_the_window_never_trip() -> None:
    brake = MassDeletionBrake(max_count=2, window=10)
    assert all(brake.admit(t * 5.0).admitted for t in range(100))


def test_acknowledge_releases_the_pause() -> None:
    brake = MassDeletionBrake(max_count=1, window=60)
    brake.admit(0.0)
    assert brake.admit(1.0).tripped
    brake.acknowledge()
    assert brake.paused_until is None
    assert brake.admit(2.0).admitted


def test_disabled_brake_admits_everything() -> None:
    brake = MassDeletionBrake(max_count=1, window=60, enabled=False)
    assert all(brake.admit(0.0).admitted for _ in range(1000))


@pytest.mark.parametrize(("count", "window"), [(0, 1.0), (1, 0.0), (1, -5.0)])
def test_brake_settings_are_checked(count: int, window: float) -> None:
    with pytest.raises(ValueError):
        MassDeletionBrake(max_count=count, window=window)


@settings(max_examples=300)
@given(
    steps=gaps,
    max_count=st.integers(min_value=1, max_value=10),
    window=st.floats(min_value=0.5, max_value=20),
)
def test_brake_never_admits_more_than_max_count_per_window(
    steps: list[float], max_count: int, window: float
) -> None:
    brake = MassDeletionBrake(max_count=max_count, window=window)
    admitted: list[float] = []
    pause_until: float | None = None
    for t in arrivals(steps):
        decision = brake.admit(t)
        if decision.admitted:
            assert pause_until is None or t >= pause_until
            admitted.append(t)
            pause_until = None
        elif decision.tripped:
            # One alert per trip: a trip only happens when not already paused.
            assert pause_until is None or t >= pause_until
            assert decision.until == t + window
            pause_until = decision.until
        else:
            assert pause_until is not None and t < pause_until
            assert decision.until == pause_until
    for i, start in enumerate(admitted):
        inside = [t for t in admitted[i:] if t < start + window]
        assert len(inside) <= max_count
