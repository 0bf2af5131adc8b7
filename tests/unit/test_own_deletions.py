"""The uids a process deleted itself, which its watcher does not report as run.deleted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lapse.edges.kubernetes.own_deletions import OwnDeletions


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_deletion_sent_here_is_taken_once() -> None:
    own = OwnDeletions()
    own.sending("a")
    assert own.take("a") is True
    assert own.take("a") is False  # an object is deleted once
    assert own.take("never-sent") is False


def test_a_failed_deletion_is_not_ours() -> None:
    own = OwnDeletions()
    own.sending("a")
    own.failed("a")
    assert own.take("a") is False


def test_remembered_only_for_a_while() -> None:
    clock = Clock()
    own = OwnDeletions(keep_seconds=60, clock=clock)
    own.sending("old")
    clock.now += 61
    assert own.take("old") is False
    own.sending("kept")
    clock.now += 59
    assert own.take("kept") is True


def test_expired_ones_are_dropped_when_more_are_sent() -> None:
    """A process with no watcher (a reaper on Knative) never takes anything: it must not
    grow past the last minute of its deletions."""
    clock = Clock()
    own = OwnDeletions(keep_seconds=60, clock=clock)
    for i in range(100):
        own.sending(f"u{i}")
        clock.now += 1
    assert len(own) == 61


@given(st.lists(st.text(min_size=1, max_size=4), max_size=300), st.integers(1, 50))
def test_never_more_than_its_capacity(uids: list[str], capacity: int) -> None:
    own = OwnDeletions(capacity=capacity)
    for uid in uids:
        own.sending(uid)
        assert len(own) <= capacity
    # The newest is always remembered.
    if uids:
        assert own.take(uids[-1]) is True
