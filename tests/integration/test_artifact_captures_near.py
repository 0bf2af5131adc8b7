"""The captures' path index on a real NATS key-value bucket (lapse/edges/artifacts/
captures.py): `near` finds the keys other runs' captures hold above, at or under a key, by
whole '/'-separated parts, and forgets a run's once its artifacts are done."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.js import JetStreamContext

from lapse.edges.artifacts import NatsCaptures
from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture

pytestmark = [pytest.mark.nats]


def _capture(uid: str, *keys: str) -> RunCapture:
    items = tuple(CapturedItem(store="art", key=k, tree=k.endswith("/")) for k in keys)
    return RunCapture(uid=uid, items=items)


async def test_near_finds_other_runs_keys_above_at_and_under_a_key(
    lapse_streams: JetStreamContext,
) -> None:
    captures = NatsCaptures(lapse_streams)
    p = f"t-{uuid.uuid4().hex[:8]}"
    mine = _capture(f"u-{p}-1", f"{p}/team-a/wf/")
    above = _capture(f"u-{p}-2", f"{p}/team-a")
    under = _capture(f"u-{p}-3", f"{p}/team-a/wf/ckpt", f"{p}/team-a/wf/x y/é")
    beside = _capture(f"u-{p}-4", f"{p}/team-a/wf2/out", f"{p}/team-a/w", f"{p}/other/wf/")
    for capture in (mine, above, under, beside):
        await captures.put(capture)

    found = await captures.near(mine.items, mine.uid)
    assert {(n.item.key, n.by) for n in found} == {
        (f"{p}/team-a", (above.uid,)),
        (f"{p}/team-a/wf/ckpt", (under.uid,)),
        (f"{p}/team-a/wf/x y/é", (under.uid,)),
    }
    await captures.forget(under)
    found = await captures.near(mine.items, mine.uid)
    assert {n.item.key for n in found} == {f"{p}/team-a"}
    for capture in (mine, above, beside):
        await captures.forget(capture)


async def test_every_listing_is_whole_when_many_run_at_once(
    lapse_streams: JetStreamContext,
) -> None:
    """Under load, nats-py's key watch could end before keys already on their way had
    arrived (a CI run missed the key above; an ad-hoc run of the old listing, 500 at once
    in rounds of 50, came back short once): a key another run holds would then not keep
    what it shields. Each listing ends on the message that says none follow."""
    captures = NatsCaptures(lapse_streams)
    p = f"t-{uuid.uuid4().hex[:8]}"
    mine = _capture(f"u-{p}-1", f"{p}/team-a/wf/")
    others = [_capture(f"u-{p}-{i}", f"{p}/team-a", f"{p}/team-a/wf/o{i}") for i in range(2, 6)]
    for capture in (mine, *others):
        await captures.put(capture)
    expected = {(f"{p}/team-a", tuple(o.uid for o in others))} | {
        (f"{p}/team-a/wf/o{i}", (f"u-{p}-{i}",)) for i in range(2, 6)
    }
    for _ in range(6):
        rounds = await asyncio.gather(*(captures.near(mine.items, mine.uid) for _ in range(40)))
        for found in rounds:
            assert {(n.item.key, tuple(sorted(n.by))) for n in found} == expected
    shared = await asyncio.gather(
        *(captures.sharers(others[0].items[0], mine.uid) for _ in range(40))
    )
    assert all(sorted(s) == sorted(o.uid for o in others) for s in shared)
    for capture in (mine, *others):
        await captures.forget(capture)
