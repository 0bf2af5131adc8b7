"""Which kinds this process should watch when several `lapse up` share one NATS: pure.

Each kind's watch is held by one process at a time through a lease (lapse/edges/
watch_leases.py, lapse/runtime/watch_lease.py does the I/O). This module decides, from
what the lease bucket showed, which free kinds to take and which held ones to hand over,
and when a holder that could not renew must stop watching.

Spreading: the kinds, in their configured order, are dealt round-robin over the live
processes sorted by name; a process takes a free kind dealt to it at once, and any other
free kind once it has stayed free for a whole round (its dealt process may not have seen
the same members yet), either only while it holds fewer than its share (ceil(kinds /
processes)). A process holding more than its share hands over those not dealt to it, so a
process that joins gets work without anyone dying. Nobody ever takes a held lease: a kind
moves only when its holder releases it or its lease expires.

Giving up: a holder's lease expires in the bucket `ttl` after its last write was stored,
which is after the holder sent it; the holder counts from the send. So stopping once
`ttl - margin` has passed since the last renewal it sent that was acknowledged stops it
before the key can expire and anyone else can take the kind (clocks are not compared: each
side measures its own interval).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A holder stops watching this share of the ttl before its lease could expire.
GIVE_UP_MARGIN = 0.25
# Renewals per ttl: three may fail in a row before the holder gives up.
RENEWALS_PER_TTL = 4


@dataclass(frozen=True)
class Moves:
    """What to do this round: kinds to take (free now) and held kinds to hand over."""

    take: tuple[str, ...] = ()
    release: tuple[str, ...] = ()


def share(kinds: int, members: int) -> int:
    """The most kinds one process holds while `members` processes share `kinds`."""
    return math.ceil(kinds / max(members, 1))


def dealt(kinds: Sequence[str], members: Sequence[str]) -> dict[str, str]:
    """Each kind's process when the kinds are dealt round-robin over the sorted members."""
    ordered = sorted(set(members))
    if not ordered:
        return {}
    return {kind: ordered[i % len(ordered)] for i, kind in enumerate(kinds)}


def plan(
    me: str,
    kinds: Sequence[str],
    members: Sequence[str],
    holders: Mapping[str, str | None],
    free_before: frozenset[str] = frozenset(),
) -> Moves:
    """This round's moves for the process `me`.

    `members` are the live processes (`me` among them, added if missing); `holders` each
    kind's lease holder (None: free); `free_before` the kinds already free in the previous
    round (taken by anyone with room, whoever they were dealt to).
    """
    everyone = sorted({*members, me})
    deal = dealt(kinds, everyone)
    mine = [kind for kind in kinds if holders.get(kind) == me]
    most = share(len(kinds), len(everyone))
    release = [kind for kind in mine if deal[kind] != me][: max(len(mine) - most, 0)]
    held = len(mine) - len(release)
    take: list[str] = []
    for kind in kinds:
        if holders.get(kind) is not None:
            continue
        # Never past the share, even for a kind dealt to me: a process full of kinds dealt
        # to others keeps them, and its own stay free one round for whoever has room
        # (taking them anyway made two full processes pass kinds round and round).
        if held < most and (deal[kind] == me or kind in free_before):
            take.append(kind)
            held += 1
    return Moves(tuple(take), tuple(release))


def must_give_up(last_renewed: float, now: float, ttl: float) -> bool:
    """Whether a holder whose last acknowledged renewal was sent at `last_renewed` must
    stop watching now (monotonic seconds): before its lease can expire for the others."""
    return now - last_renewed >= ttl * (1 - GIVE_UP_MARGIN)


def round_interval(ttl: float) -> float:
    """How often leases are renewed and the bucket looked at."""
    return ttl / RENEWALS_PER_TTL
