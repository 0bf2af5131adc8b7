"""The watch lease's pure decisions (lapse/runtime/lease_plan.py): who takes which kind,
who hands one over, and when a holder stops watching."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lapse.runtime.lease_plan import Moves, dealt, must_give_up, plan, round_interval, share

KINDS = ["argo-workflow", "tekton-pipelinerun", "tekton-taskrun", "job", "trainjob"]


def settle(
    members: list[str], holders: dict[str, str | None], rounds: int = 6
) -> dict[str, str | None]:
    """Every member plays `rounds` rounds in turn on a shared view, as the bucket would
    show it (a take succeeds only on a free kind; a release frees it)."""
    holders = dict(holders)
    free_before = {m: frozenset[str]() for m in members}
    for _ in range(rounds):
        for me in members:
            moves = plan(me, KINDS, members, holders, free_before[me])
            for kind in moves.release:
                assert holders[kind] == me
                holders[kind] = None
            free_before[me] = frozenset(k for k in KINDS if holders.get(k) is None)
            for kind in moves.take:
                if holders.get(kind) is None:  # the bucket's create: first one wins
                    holders[kind] = me
    return holders


def test_one_process_takes_every_kind_at_once() -> None:
    assert plan("a", KINDS, ["a"], {}) == Moves(take=tuple(KINDS))


def test_two_processes_spread_the_kinds_instead_of_the_first_taking_all() -> None:
    first = plan("a", KINDS, ["a", "b"], {})
    second = plan("b", KINDS, ["a", "b"], {})
    assert set(first.take).isdisjoint(second.take)
    assert len(first.take) == 3 and len(second.take) == 2


def test_nobody_takes_a_held_kind() -> None:
    holders: dict[str, str | None] = dict.fromkeys(KINDS, "a")
    everything_free_before = frozenset(KINDS)
    assert plan("b", KINDS, ["a", "b"], holders, everything_free_before).take == ()


def test_a_process_that_joins_gets_kinds_handed_over() -> None:
    holders: dict[str, str | None] = dict.fromkeys(KINDS, "a")
    moves = plan("a", KINDS, ["a", "b"], holders)
    assert moves.take == ()
    assert set(moves.release) == {k for k, m in dealt(KINDS, ["a", "b"]).items() if m == "b"}
    assert settle(["a", "b"], holders) == {k: dealt(KINDS, ["a", "b"])[k] for k in KINDS}


def test_the_kinds_of_a_process_that_died_are_taken_by_the_others() -> None:
    holders: dict[str, str | None] = dict(dealt(KINDS, ["a", "b", "c"]))
    # "c" died: its leases expired, and it is no longer a member.
    freed: dict[str, str | None] = {k: (None if h == "c" else h) for k, h in holders.items()}
    after = settle(["a", "b"], freed)
    assert all(after[k] in {"a", "b"} for k in KINDS)


def test_a_free_kind_dealt_to_a_busy_process_is_taken_by_one_with_room_next_round() -> None:
    # "a" sees "b", which does not exist any more (its member key not yet expired): the
    # kind dealt to "b" stays free one round, then "a" takes it.
    members = ["a", "b"]
    holders: dict[str, str | None] = {
        k: ("a" if d == "a" else None) for k, d in dealt(KINDS, members).items()
    }
    first = plan("a", KINDS, ["a"], holders)
    assert set(first.take) == {k for k, h in holders.items() if h is None}


@settings(max_examples=300, deadline=None)
@given(
    members=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=6, unique=True),
    initial=st.lists(st.sampled_from([None, *"abcdefg"]), min_size=len(KINDS), max_size=len(KINDS)),
)
# Two processes full of kinds dealt to others, a third with none: taking a dealt kind past
# the share made the kinds pass round and round, one left unwatched.
@example(members=["a", "b", "c"], initial=["b", "a", "b", None, "a"])
def test_any_start_settles_to_every_kind_watched_once_and_evenly(
    members: list[str], initial: list[str | None]
) -> None:
    # Holders that are not members died: their leases expired.
    holders = {k: (h if h in members else None) for k, h in zip(KINDS, initial, strict=True)}
    after = settle(members, holders)
    assert all(after[k] in members for k in KINDS), after
    counts = [sum(1 for h in after.values() if h == m) for m in members]
    assert max(counts) <= share(len(KINDS), len(members))
    # Settled: nobody moves any more.
    for me in members:
        assert plan(me, KINDS, members, after, frozenset()) == Moves()


def test_share_is_the_ceiling() -> None:
    assert [share(5, n) for n in (1, 2, 3, 4, 5, 6)] == [5, 3, 2, 2, 1, 1]
    assert share(5, 0) == 5


@given(
    ttl=st.floats(min_value=1.0, max_value=600.0),
    renewed=st.floats(min_value=0.0, max_value=1e6),
    elapsed=st.floats(min_value=0.0, max_value=1e3),
)
def test_a_holder_gives_up_before_its_lease_can_expire_and_not_while_renewals_succeed(
    ttl: float, renewed: float, elapsed: float
) -> None:
    gives_up = must_give_up(renewed, renewed + elapsed, ttl)
    # The bucket removes the key ttl after the write was stored (after it was sent): the
    # holder has stopped by then.
    if elapsed >= ttl:
        assert gives_up
    # Renewals a round apart never make it give up, even with two of them lost.
    if elapsed <= 2 * round_interval(ttl):
        assert not gives_up
