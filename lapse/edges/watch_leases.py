"""Who watches which kind when several `lapse up` share one NATS: the `LAPSE_LEASES` bucket.

Two kinds of key, both scoped by the API server (a hash of its URL: processes watching
different clusters through one NATS do not compete):

- `lease.<cluster>.<kind>`: the process holding that kind's watch. Taken with a create
  (only if absent), renewed with an update naming the revision last written (a CAS: a
  holder that lost its lease learns it there), released by a delete naming it.
- `member.<cluster>.<process>`: a live process, written every round; the kinds are spread
  over these (lapse/runtime/lease_plan.py).

The bucket's TTL is the lease's: a key not written again for `ttl` seconds is removed by
the server, so a process killed with -9 loses its leases `ttl` after its last renewal
without anyone comparing clocks. The first process makes the bucket; its TTL is the one
every process then uses (`ttl` read back from the bucket).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from lapse.edges.nats import LazyBucket

BUCKET: Final = "LAPSE_LEASES"
LEASE_PREFIX: Final = "lease."
MEMBER_PREFIX: Final = "member."


def cluster_key(cluster: str) -> str:
    """An API server's URL as a key token."""
    return hashlib.sha256(cluster.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Lease:
    kind: str
    holder: str
    revision: int


@dataclass(frozen=True)
class Held:
    """One kind's holder, as `lapse status` shows it."""

    cluster: str  # the API server's URL
    kind: str
    holder: str


class WatchLeases:
    """The leases of one API server's kinds, as one process (`me`) sees and takes them."""

    def __init__(
        self, js: JetStreamContext, cluster: str, me: str, *, ttl: float, replicas: int = 1
    ) -> None:
        self.cluster = cluster
        self._scope = cluster_key(cluster)
        self.me = me
        self.ttl = ttl
        self._kv = LazyBucket(
            js,
            KeyValueConfig(
                bucket=BUCKET,
                description="Which lapse up process watches which kind",
                history=1,
                ttl=ttl,
                replicas=replicas,
            ),
        )
        self._ttl_read = False

    async def _bucket(self) -> KeyValue:
        kv = await self._kv()
        if not self._ttl_read:
            # Whoever made the bucket chose the TTL: every holder gives up by it.
            status = await kv.status()
            if status.ttl:
                self.ttl = float(status.ttl)
            self._ttl_read = True
        return kv

    def _lease_key(self, kind: str) -> str:
        return f"{LEASE_PREFIX}{self._scope}.{kind}"

    def _body(self) -> bytes:
        return json.dumps({"holder": self.me, "cluster": self.cluster}).encode()

    async def join(self) -> None:
        """Say this process is alive (every round)."""
        kv = await self._bucket()
        await kv.put(f"{MEMBER_PREFIX}{self._scope}.{self.me}", self._body())

    async def members(self) -> list[str]:
        """The processes alive on this API server (written within the TTL)."""
        prefix = f"{MEMBER_PREFIX}{self._scope}."
        return [key.removeprefix(prefix) for key in await self._keys() if key.startswith(prefix)]

    async def holders(self, kinds: list[str]) -> dict[str, Lease | None]:
        kv = await self._bucket()
        found: dict[str, Lease | None] = {}
        for kind in kinds:
            try:
                entry = await kv.get(self._lease_key(kind))
            except KeyNotFoundError:  # never taken, released, or expired
                found[kind] = None
                continue
            holder = _holder(entry.value)
            found[kind] = Lease(kind, holder, entry.revision or 0) if holder else None
        return found

    async def take(self, kind: str) -> int | None:
        """Take the free lease of `kind`: its revision, or None when another took it first."""
        kv = await self._bucket()
        try:
            return await kv.create(self._lease_key(kind), self._body())
        except KeyWrongLastSequenceError:
            return None

    async def renew(self, kind: str, revision: int) -> int | None:
        """Write the lease again: its new revision, or None when it is no longer ours."""
        kv = await self._bucket()
        try:
            return await kv.update(self._lease_key(kind), self._body(), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def release(self, kind: str, revision: int) -> None:
        """Hand the lease back (only if still ours): the next process takes it at once."""
        kv = await self._bucket()
        with contextlib.suppress(KeyWrongLastSequenceError, KeyNotFoundError):
            await kv.delete(self._lease_key(kind), last=revision)

    async def leave(self) -> None:
        kv = await self._bucket()
        with contextlib.suppress(KeyNotFoundError):
            await kv.delete(f"{MEMBER_PREFIX}{self._scope}.{self.me}")

    async def _keys(self) -> list[str]:
        kv = await self._bucket()
        try:
            return list(await kv.keys())
        except NoKeysError:
            return []


def _holder(value: bytes | None) -> str:
    try:
        body = json.loads(value or b"{}")
    except ValueError:
        return ""
    holder = body.get("holder") if isinstance(body, dict) else None
    return holder if isinstance(holder, str) else ""


async def read_holders(js: JetStreamContext) -> list[Held]:
    """Every kind's holder, on every API server (for `lapse status`)."""
    try:
        kv = await js.key_value(BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return []
    found = []
    for key in keys:
        if not key.startswith(LEASE_PREFIX):
            continue
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # released meanwhile
            continue
        try:
            body = json.loads(entry.value or b"{}")
        except ValueError:
            continue
        kind = key.removeprefix(LEASE_PREFIX).partition(".")[2]
        found.append(Held(str(body.get("cluster", "")), kind, str(body.get("holder", ""))))
    return sorted(found, key=lambda held: (held.cluster, held.kind))
