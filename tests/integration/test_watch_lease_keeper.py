"""The watch lease keeper (lapse/runtime/watch_lease.py) on a real nats-server: a holder
whose lease is taken by CAS, or that NATS is cut off from, stops watching before another
process could start; a clean stop hands the kinds over at once.

The watchers are stand-ins that only record whether they run: what is tested is when the
keeper starts and stops them (the real watcher through `lapse up`: tests/e2e/
test_lapse_up.py, the two-process test)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from lapse.edges.nats import connect
from lapse.edges.watch_leases import WatchLeases
from lapse.embedded.nats import EmbeddedNats
from lapse.runtime.watch_lease import LeaseKeeper
from lapse.runtime.watcher import KindWatcher
from tests.stack import wait_for

TTL = 2.0
KINDS = ("argo-workflow", "tekton-pipelinerun", "job")
CLUSTER = "https://apiserver.test:6443"


@dataclass
class Kind:
    name: str


@dataclass
class StandIn:
    """Runs until stopped (or cancelled); records when it stopped."""

    kind: Kind
    running: bool = False
    stopped_at: list[float] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        self.running = True
        try:
            await stop.wait()
        finally:
            self.running = False
            self.stopped_at.append(time.monotonic())


@dataclass
class Process:
    keeper: LeaseKeeper
    watchers: list[StandIn]
    stop: asyncio.Event
    task: asyncio.Task[None]

    def watching(self) -> set[str]:
        return {w.kind.name for w in self.watchers if w.running}


@contextlib.asynccontextmanager
async def process(url: str, me: str) -> AsyncIterator[Process]:
    nc = await connect(url)
    watchers = [StandIn(Kind(name)) for name in KINDS]
    leases = WatchLeases(nc.jetstream(), CLUSTER, me, ttl=TTL)
    keeper = LeaseKeeper(leases, cast(list[KindWatcher], watchers))
    stop = asyncio.Event()
    task = asyncio.create_task(keeper.run(stop))
    try:
        yield Process(keeper, watchers, stop, task)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        with contextlib.suppress(Exception):
            await nc.close()


async def test_two_keepers_split_the_kinds_and_a_clean_stop_hands_them_over(
    own_nats: EmbeddedNats,
) -> None:
    async with process(own_nats.url, "a") as a, process(own_nats.url, "b") as b:

        async def split() -> bool:
            both = [a.watching(), b.watching()]
            return all(both) and both[0].isdisjoint(both[1]) and set.union(*both) == set(KINDS)

        await wait_for(split, timeout=10, interval=0.1)
        a.stop.set()
        await a.task
        assert not a.watching()
        # Released, not left to expire: taken within a round or two, well before the TTL.
        started = time.monotonic()
        await wait_for(lambda: _now(b.watching() == set(KINDS)), timeout=TTL, interval=0.05)
        assert time.monotonic() - started < TTL


async def test_a_lease_taken_by_cas_stops_the_watch(own_nats: EmbeddedNats) -> None:
    async with process(own_nats.url, "a") as a:
        await wait_for(lambda: _now(a.watching() == set(KINDS)), timeout=10, interval=0.1)
        nc = await connect(own_nats.url)
        kv = await nc.jetstream().key_value("LAPSE_LEASES")
        key = next(k for k in await kv.keys() if k.endswith(".job") and k.startswith("lease."))
        await kv.put(key, b'{"holder": "intruder"}')  # another revision than a's
        await wait_for(lambda: _now("job" not in a.watching()), timeout=TTL, interval=0.05)
        await nc.close()


async def test_cut_off_from_nats_the_holder_stops_before_its_lease_can_expire(
    own_nats: EmbeddedNats,
) -> None:
    async with process(own_nats.url, "a") as a:
        await wait_for(lambda: _now(a.watching() == set(KINDS)), timeout=10, interval=0.1)
        own_nats.stop()
        # When each lease's last acknowledged renewal was sent: the server, had it lived,
        # would drop the key TTL after storing that write, so no earlier than TTL after this.
        renewed = {kind: h.renewed for kind, h in a.keeper.holding.items()}
        assert set(renewed) == set(KINDS)
        await wait_for(lambda: _now(not a.watching()), timeout=2 * TTL, interval=0.05)
        for watcher in a.watchers:
            (stopped,) = watcher.stopped_at
            assert stopped < renewed[watcher.kind.name] + TTL, stopped - renewed[watcher.kind.name]
        assert a.keeper.held() == []


async def _now(value: Any) -> bool:
    return bool(value)
