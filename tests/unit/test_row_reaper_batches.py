"""How the row-reaper cuts a fetch into transactions (functions/row_reaper/batches.py):
no two events in one transaction name the same uid or row key, as a database compares them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lapse.functions.row_reaper.batches import row_keys, split


def test_keys_that_mysql_would_match_are_one_key() -> None:
    # MySQL's default collations ignore case and trailing spaces: `WHERE UUID IN ('ABC ')`
    # finds the row `abc`, so the two must never share a transaction.
    assert row_keys(["u1"], {"kfp": "ABC "}) & row_keys(["u2"], {"kfp": "abc"})


def test_the_same_key_in_another_target_or_as_a_uid_is_another_row() -> None:
    assert not row_keys(["u1"], {"kfp": "k"}) & row_keys(["u2"], {"argo_archive": "k"})
    assert not row_keys(["k"], {}) & row_keys(["u2"], {"kfp": "k"})


def test_an_event_sharing_a_key_waits_and_so_does_a_later_one_behind_it() -> None:
    a = row_keys(["u1"], {"kfp": "r1"})
    b = row_keys(["u2"], {"kfp": "r1", "ml_metadata": "r2"})
    c = row_keys(["u3"], {"ml_metadata": "r2"})
    d = row_keys(["u4"], {"kfp": "r4"})
    # b names a's rows; c names b's: c must not overtake b.
    assert split([a, b, c, d], lambda keys: keys) == ([a, d], [b, c])


def test_the_same_uid_waits_whatever_its_rows() -> None:
    first = row_keys(["u1", "u1"], {"kfp": "r1"})
    again = row_keys(["other", "u1"], {"kfp": "r9"})
    assert split([first, again], lambda keys: keys) == ([first], [again])


keyed = st.frozensets(st.tuples(st.sampled_from(["uid", "kfp"]), st.sampled_from("abcd")))


@given(st.lists(keyed, max_size=12))
def test_split_keeps_every_event_once_in_order_and_no_key_twice(
    items: list[frozenset[tuple[str, str]]],
) -> None:
    indexed = list(enumerate(items))
    taken, later = split(indexed, lambda item: item[1])
    assert sorted(taken + later) == indexed
    assert taken == sorted(taken) and later == sorted(later)
    seen: set[object] = set()
    for _, keys in taken:
        assert not seen & keys
        seen |= keys
    if indexed:
        assert taken[0] == indexed[0]


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("007", "7"),  # an integer column: both are 7
        ("+7", " 7"),
        ("0" * 31 + "1", "00000000-0000-0000-0000-000000000001"),  # a UUID column
        ("urn:uuid:" + "A" * 32, "a" * 32),
        ("café", "CAFE"),  # MySQL's accent- and case-insensitive collations
    ],
)
def test_keys_a_column_type_would_match_are_one_key(one: str, other: str) -> None:
    assert row_keys(["u1"], {"t": one}) & row_keys(["u2"], {"t": other})


def test_different_keys_stay_apart() -> None:
    assert not row_keys(["u1"], {"t": "7"}) & row_keys(["u2"], {"t": "-7"})
    assert not row_keys(["u1"], {"t": "run-a"}) & row_keys(["u2"], {"t": "run-b"})
