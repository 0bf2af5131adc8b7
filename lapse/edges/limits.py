"""Deletion limits shared by every reaper process, kept in NATS: the rate limit and the
mass-deletion brake (`lapse.functions.ratelimit.RateLimit`, `Brake`) for the whole deployment,
however many object-reaper pods or `lapse up` replicas run.

State lives in a JetStream key-value bucket (`LAPSE_LIMITS`), changed only with optimistic
concurrency (create-if-absent, update-if-revision-unchanged), so concurrent processes never
both take the last slot; a lost race is simply retried on the new value.

- Rate: time is cut into slots of max(1 s, 1/rate) holding rate x slot deletions each; one
  key per slot (`rate.<n>`) counts what was taken. A reservation takes a place in the first
  slot with room and waits for that slot: excess work is delayed in arrival order, never
  dropped, and the deployment's rate is the configured one (bursts up to one slot's worth).
- Brake: one key per window (`brake.<n>`) counts admitted deletions; the count over the
  last `window` is estimated from this window's and the previous one's (weighted by how much
  of the previous one is still inside the last `window`), so a burst straddling a boundary is
  seen. Going over `max_count` engages the brake: `brake.engaged` holds when it ends. Exactly
  one process wins the write that engages it and reports `tripped` (one alert per
  deployment); the others are told to pause until the same time. `lapse brake release`
  deletes `brake.engaged` and the counts.

Each process takes places and counts in leases (a tenth of a slot, a fiftieth of
`max_count`) and hands them out itself, so a deletion costs a fraction of a round trip;
what it leaves unused is lost, which errs on the safe side (slower, a brake sooner).
Keys outlive their window by the bucket's max age only (history 1): the bucket stays small.

Each target has its own limits with the same settings: the objects' keys are as above (as
they always were), the database rows' are the same keys under `rows.` (`ROWS`), the
artifacts' under `artifacts.` (`ARTIFACTS`, counting objects in object storage), so a run's
object, rows and artifacts never count against one another's limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from lapse.edges.nats import key_value_bucket
from lapse.functions.ports import RetryLater
from lapse.functions.ratelimit import ADMITTED, BrakeDecision

BUCKET: Final = "LAPSE_LIMITS"
ENGAGED: Final = "brake.engaged"
# The scopes: the object reapers' limits, and the row-reapers'.
OBJECTS: Final = ""
ROWS: Final = "rows"
ARTIFACTS: Final = "artifacts"  # counted in objects, not runs
SCOPES: Final = {"kubernetes": OBJECTS, "database": ROWS, "artifacts": ARTIFACTS}


def _scoped(scope: str, key: str) -> str:
    return f"{scope}.{key}" if scope else key


# How long a key is kept after its last write; longer than any window it counts.
MIN_MAX_AGE: Final = 600.0


async def limits_bucket(js: JetStreamContext, *, window: float, replicas: int = 1) -> KeyValue:
    """The shared bucket, created on first use (every process may try: creating an existing
    bucket with the same settings is a no-op)."""
    config = KeyValueConfig(
        bucket=BUCKET,
        description="lapse: deletion rate and mass-deletion brake shared by every reaper",
        history=1,
        ttl=max(MIN_MAX_AGE, 3 * window),
        storage=StorageType.FILE,
        replicas=replicas,
    )
    return await key_value_bucket(js, config)


@contextlib.asynccontextmanager
async def _unavailable_is_transient() -> AsyncIterator[None]:
    """NATS not answering is an outage to wait out (the event is delivered again), never a
    reason to delete without the limits or to dead-letter the deletion."""
    try:
        yield
    except (NatsError, TimeoutError) as exc:
        raise RetryLater(f"deletion limits (NATS bucket {BUCKET}) unavailable: {exc}") from exc


async def _count(kv: KeyValue, key: str) -> tuple[int, int]:
    """The count under `key` and its revision (0, 0 when absent)."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return 0, 0
    return int(entry.value or b"0"), entry.revision or 0


async def _increment(kv: KeyValue, key: str, seen: int, revision: int, by: int = 1) -> bool:
    """seen + by if nobody changed the key since it was read; False when someone did."""
    try:
        if revision == 0:
            await kv.create(key, str(seen + by).encode())
        else:
            await kv.update(key, str(seen + by).encode(), last=revision)
    except KeyWrongLastSequenceError:
        return False
    return True


class NatsRateLimit:
    """`lapse.functions.ratelimit.RateLimit` for the whole deployment."""

    def __init__(self, kv: KeyValue, rate: float, *, scope: str = OBJECTS) -> None:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate must be a positive finite number, not {rate!r}")
        self._kv = kv
        self._scope = scope
        self.slot = max(1.0, 1.0 / rate)
        self.per_slot = max(1, round(rate * self.slot))
        # Places are taken a tenth of a slot at a time and handed out here, so a deletion
        # costs a fraction of a round trip. Places a process leaves unused in a slot are
        # lost to it: the deployment may delete a little slower than the rate, never faster.
        self.lease = max(1, math.ceil(self.per_slot / 10))
        self._leased_slot = -1
        self._left = 0
        # One reservation in flight per process: concurrent handlers would only race each
        # other for the same key; the races left are between processes.
        self._one = asyncio.Lock()

    async def reserve(self, now: float) -> float:
        async with self._one, _unavailable_is_transient():
            return await self._reserve(now)

    async def _reserve(self, now: float) -> float:
        slot = math.floor(now / self.slot)
        if self._left > 0 and self._leased_slot >= slot:
            self._left -= 1
            return max(0.0, self._leased_slot * self.slot - now)
        slot = max(slot, self._leased_slot)  # never back to a slot already given out here
        while True:
            key = _scoped(self._scope, f"rate.{slot}")
            count, revision = await _count(self._kv, key)
            if count >= self.per_slot:
                slot += 1
                continue
            take = min(self.lease, self.per_slot - count)
            if await _increment(self._kv, key, count, revision, by=take):
                self._leased_slot, self._left = slot, take - 1
                return max(0.0, slot * self.slot - now)


@dataclass(frozen=True)
class Engaged:
    until: float
    since: float


async def engaged(kv: KeyValue, scope: str = OBJECTS) -> tuple[Engaged | None, int]:
    try:
        entry = await kv.get(_scoped(scope, ENGAGED))
    except KeyNotFoundError:
        return None, 0
    data = json.loads(entry.value or b"{}")
    return Engaged(until=float(data["until"]), since=float(data["since"])), entry.revision or 0


class NatsBrake:
    """`lapse.functions.ratelimit.Brake` for the whole deployment."""

    def __init__(
        self,
        kv: KeyValue,
        max_count: int,
        window: float,
        *,
        enabled: bool = True,
        scope: str = OBJECTS,
    ):
        if max_count < 1:
            raise ValueError(f"max_count must be at least 1, not {max_count!r}")
        if not window > 0:
            raise ValueError(f"window must be positive, not {window!r}")
        self._kv = kv
        self._scope = scope
        self.max_count = max_count
        self.window = float(window)
        self.enabled = enabled
        # Counts are taken a fiftieth of max_count at a time, as NatsRateLimit's places:
        # counted when taken, so unused ones only make the brake trip a little sooner.
        self.lease = max(1, max_count // 50)
        self._leased_window = -1
        self._left = 0
        self._one = asyncio.Lock()  # as NatsRateLimit's

    async def admit(self, now: float) -> BrakeDecision:
        if not self.enabled:
            return ADMITTED
        async with self._one, _unavailable_is_transient():
            return await self._admit(now)

    async def _admit(self, now: float) -> BrakeDecision:
        index = math.floor(now / self.window)
        if self._left > 0 and self._leased_window == index:
            self._left -= 1
            return ADMITTED
        while True:
            current, revision = await engaged(self._kv, self._scope)
            if current is not None and now < current.until:
                return BrakeDecision(admitted=False, until=current.until)
            count, count_revision = await _count(self._kv, self._key(f"brake.{index}"))
            previous, _ = await _count(self._kv, self._key(f"brake.{index - 1}"))
            still_inside = 1.0 - (now / self.window - index)
            # Counting only since the brake last released: a pause is one whole window, so
            # the previous window's deletions were judged before it.
            if current is not None and current.since >= (index - 1) * self.window:
                previous = 0
            room = self.max_count - (count + previous * still_inside)
            if room < 1:
                if await self._engage(now, revision):
                    return BrakeDecision(admitted=False, until=now + self.window, tripped=True)
                continue  # another process engaged it first: pause until its time
            take = min(self.lease, int(room))
            if await _increment(
                self._kv, self._key(f"brake.{index}"), count, count_revision, by=take
            ):
                self._leased_window, self._left = index, take - 1
                return ADMITTED

    def _key(self, key: str) -> str:
        return _scoped(self._scope, key)

    async def _engage(self, now: float, revision: int) -> bool:
        value = json.dumps({"until": now + self.window, "since": now}).encode()
        try:
            if revision == 0:
                await self._kv.create(self._key(ENGAGED), value)
            else:
                await self._kv.update(self._key(ENGAGED), value, last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True


async def engage(kv: KeyValue, scope: str, *, now: float, seconds: float) -> Engaged:
    """Engage the brake by hand until `now + seconds` (an operator's pause, `lapse brake
    engage`): every process pauses deleting once it next reads the brake, after the
    deletions it already counted in (a fiftieth of max_due at most: NatsBrake's lease)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, not {seconds!r}")
    until = Engaged(until=now + seconds, since=now)
    value = json.dumps({"until": until.until, "since": until.since}).encode()
    await kv.put(_scoped(scope, ENGAGED), value)
    return until


async def release(kv: KeyValue, scope: str = OBJECTS) -> Engaged | None:
    """Release an engaged brake for every process, with a fresh count. Returns what was
    engaged (None: it was not)."""
    current, _ = await engaged(kv, scope)
    keys = [k for k in await _keys(kv) if k.startswith(_scoped(scope, "brake."))]
    for key in keys:
        await kv.purge(key)
    return current


async def _keys(kv: KeyValue) -> list[str]:
    try:
        return list(await kv.keys())
    except Exception:  # nats-py raises NoKeysError on an empty bucket
        return []
