"""One reaper-like process for tests/integration/test_cluster_limits.py: takes `count`
deletion slots from the shared limits (lapse/edges/limits.py) as fast as they are given and
prints, as JSON, when each was used and what the brake said."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import nats

from lapse.edges.limits import NatsBrake, NatsRateLimit, limits_bucket


async def main(url: str, mode: str, count: int, rate: float, max_due: int, window: float) -> None:
    nc = await nats.connect(url)
    kv = await limits_bucket(nc.jetstream(), window=window)
    used, decisions = [], []
    if mode == "rate":
        limit = NatsRateLimit(kv, rate)
        for _ in range(count):
            wait = await limit.reserve(time.time())
            await asyncio.sleep(wait)
            used.append(time.time())
    else:
        brake = NatsBrake(kv, max_due, window)
        for _ in range(count):
            d = await brake.admit(time.time())
            decisions.append({"admitted": d.admitted, "tripped": d.tripped, "until": d.until})
    await nc.close()
    print(json.dumps({"used": used, "decisions": decisions}))


if __name__ == "__main__":
    url, mode, count, rate, max_due, window = sys.argv[1:7]
    asyncio.run(main(url, mode, int(count), float(rate), int(max_due), float(window)))
