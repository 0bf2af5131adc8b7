"""How a fetch of due events is cut into transactions (pure).

One transaction reads each row key's record once and deletes its rows once, for the first
run that named it (lapse/edges/rows: `owners_of`). Two due events naming the same rows in
one transaction would share one judgement and one deletion: the second run's
precondition would go unread (a forged event naming a running run's key had that run's
rows deleted beside another event for it), and a forged or replayed event could end
`deleted` on the strength of another event's rows. So no two events in one transaction
may name the same run uid or the same row key, however the database might compare the
keys: as text (MySQL's collations ignore case, trailing spaces and accents), as a whole
number, as a UUID (the columns' types the edge converts keys to). An event that would is
put off to a later round, proved again after the earlier round's outcomes, as if it had
been delivered after them (docs/architecture.md, "The row-reaper's batches").
"""

from __future__ import annotations

import contextlib
import unicodedata
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from typing import Final, TypeVar

T = TypeVar("T")

# The key space of run uids, beside the targets' names (a target is never named this).
UID: Final = " uid"


def forms(value: str) -> frozenset[str]:
    """Every form under which a database may find `value` equal to another key: its text
    with case, surrounding spaces and accents ignored, and the whole number or UUID it
    reads as. Two keys with a form in common are one key here: over-matching only puts an
    event off to the next round, never merges two runs' rows."""
    text = value.strip()
    plain = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    found = {f"text:{text.casefold()}", f"text:{plain.casefold()}"}
    if text.lstrip("+-").isdigit():
        with contextlib.suppress(ValueError):
            found.add(f"int:{int(text)}")
    with contextlib.suppress(ValueError):
        found.add(f"uuid:{uuid.UUID(text)}")
    return frozenset(found)


def row_keys(uids: Sequence[str], keys: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """Everything one event's transaction would key on: its run uids (the claim's and the
    stored run's) and its key per target, in every form (`forms`)."""
    named = {(UID, form) for uid in uids for form in forms(uid)}
    named |= {(target, form) for target, key in keys.items() for form in forms(key)}
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
