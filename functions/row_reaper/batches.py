"""How a fetch of due events is cut into transactions (pure).

One transaction deletes each row key once and credits its rows to the first run that
named it (lapse/edges/rows/delete.py: `owners_of`). Two due events naming the same rows in
one transaction would therefore share one deletion: a forged or replayed event could end
`deleted` on the strength of another event's rows. So no two events in one transaction
may name the same run uid or the same row key, compared the way the most lenient database
compares them (MySQL's default collations ignore case and trailing spaces); an event that
would is put off to a later round, proved again after the earlier round's outcomes, as if
it had been delivered after them (docs/architecture.md, "The row-reaper's batches").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from typing import Final, TypeVar

T = TypeVar("T")

# The key space of run uids, beside the targets' names (a target is never named this).
UID: Final = " uid"


def comparable(value: str) -> str:
    """A key as the most lenient database compares it: case and surrounding spaces
    ignored (over-matching only puts an event off to the next round, never merges two)."""
    return value.strip().casefold()


def row_keys(uids: Sequence[str], keys: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """Everything one event's transaction would key on: its run uids (the claim's and the
    stored run's) and its key per target."""
    named = {(UID, comparable(uid)) for uid in uids}
    named |= {(target, comparable(key)) for target, key in keys.items()}
    return frozenset(named)


def split(items: Sequence[T], keys_of: Callable[[T], Set[Hashable]]) -> tuple[list[T], list[T]]:
    """`items` in arrival order: those that share no key with an earlier one (one
    transaction), and the rest (the next round). A put-off item's keys stay taken, so an
    item never overtakes an earlier one it shares a key with."""
    taken: list[T] = []
    later: list[T] = []
    seen: set[Hashable] = set()
    for item in items:
        keys = keys_of(item)
        (later if seen & keys else taken).append(item)
        seen |= keys
    return taken, later
