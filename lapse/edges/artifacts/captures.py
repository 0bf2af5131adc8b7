"""Each run's artifact capture, kept beside its artifacts schedule: the NATS key-value
bucket `LAPSE_ARTIFACTS` (`lapse.functions.artifact_reaper.ports.Captures`).

A capture can be long (every output artifact of a large Workflow), so it is not put in the
schedule message; the reaper reads it by the run's uid when the schedule fires.

- `run.<uid>`: the run's capture (JSON, `RunCapture`).
- `ref.<digest>.<uid>`: "run <uid> captured the item with this digest" (sha256 of store and
  key). An item whose digest another pending run also holds is `shared`: kept. ML
  Metadata's items and the items it said another run uses (`RunCapture.metadata`, recorded
  by the row-reaper) are referenced too.

- `path.<store>.<part>...<part>.<uid>`: the same, by the key's '/'-separated parts (each
  base64url, '=' for an empty part), so the keys other runs hold above, at or under a key
  are found by the server's subject filters (`near`): a prefix never takes a key another
  run's capture holds. Captures stored before this index existed have no `path.` entries
  until their run is planned again.

Written by the planner before the schedule is put (a fired schedule always finds its
capture); removed by the artifact reaper once the run's artifacts are done. A run whose
artifacts are kept (keep, a TTL of never) keeps its capture, so what it shares stays
referenced. History 1, no age limit: an entry goes when its run's artifacts go.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Final

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from lapse.edges.nats import LazyBucket
from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture, carried
from lapse.functions.artifact_reaper.ownership import Protection
from lapse.functions.ports import RetryLater

BUCKET: Final = "LAPSE_ARTIFACTS"
# A key listing's wait for its next message, and how long the server keeps its consumer
# when the listing is abandoned.
KEYS_TIMEOUT: Final = 10.0
KEYS_INACTIVE: Final = 60.0
KV_OPERATION: Final = "KV-Operation"
MARKER_REASON: Final = "Nats-Marker-Reason"


def digest(item: CapturedItem) -> str:
    return hashlib.sha256(f"{item.store}\0{item.key}".encode()).hexdigest()[:40]


def path_tokens(key: str) -> list[str]:
    """A key's parts as subject tokens (a trailing '/' names the same path)."""
    parts = key.split("/")
    if len(parts) > 1 and parts[-1] == "":
        parts = parts[:-1]
    return [base64.urlsafe_b64encode(part.encode()).decode().rstrip("=") or "=" for part in parts]


def _part(token: str) -> str:
    if token == "=":
        return ""
    return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()


def path_key(item: CapturedItem, uid: str) -> str:
    return ".".join(("path", item.store, *path_tokens(item.key), uid))


@contextlib.asynccontextmanager
async def _unavailable_is_transient() -> AsyncIterator[None]:
    try:
        yield
    except (NatsError, TimeoutError) as exc:
        raise RetryLater(f"artifact captures (NATS bucket {BUCKET}) unavailable: {exc}") from exc


class NatsCaptures:
    def __init__(self, js: JetStreamContext, *, replicas: int = 1) -> None:
        self._bucket = LazyBucket(
            js,
            KeyValueConfig(
                bucket=BUCKET,
                description="lapse: each run's artifacts, captured when it was planned",
                history=1,
                storage=StorageType.FILE,
                replicas=replicas,
            ),
        )

    async def put(self, capture: RunCapture) -> None:
        async with _unavailable_is_transient():
            kv = await self._bucket()
            earlier = await self._get(kv, capture.uid)
            # A capture made again keeps ML Metadata's account (its rows may be gone).
            capture = carried(earlier, capture)
            for item in _referenced(capture):
                await kv.put(f"ref.{digest(item)}.{capture.uid}", b"")
                await kv.put(path_key(item, capture.uid), b"")
            if earlier is not None:
                for item in set(_referenced(earlier)) - set(_referenced(capture)):
                    await _purge(kv, f"ref.{digest(item)}.{capture.uid}")
                    await _purge(kv, path_key(item, capture.uid))
            await kv.put(f"run.{capture.uid}", capture.model_dump_json().encode())

    async def get(self, uid: str) -> RunCapture | None:
        async with _unavailable_is_transient():
            return await self._get(await self._bucket(), uid)

    async def sharers(self, item: CapturedItem, uid: str) -> tuple[str, ...]:
        async with _unavailable_is_transient():
            prefix = f"ref.{digest(item)}."
            keys = await _keys(await self._bucket(), f"{prefix}*")
            return tuple(key[len(prefix) :] for key in keys if key != f"{prefix}{uid}")

    async def near(self, items: Sequence[CapturedItem], uid: str) -> list[Protection]:
        async with _unavailable_is_transient():
            kv = await self._bucket()
            # Above: exactly at each shorter path. At or under: the path and anything deeper.
            # The items of one run share their upper paths: each filter is read once.
            filters: dict[str, str] = {}
            for item in items:
                tokens = path_tokens(item.key)
                base = ("path", item.store)
                for depth in range(1, len(tokens)):
                    filters.setdefault(".".join((*base, *tokens[:depth], "*")), item.store)
                filters.setdefault(".".join((*base, *tokens, ">")), item.store)
            by: dict[tuple[str, str], list[str]] = {}
            for subject, store in filters.items():
                for key in await _keys(kv, subject):
                    *parts, other = key.split(".")[2:]
                    path = "/".join(_part(t) for t in parts)
                    if other != uid and other not in (uids := by.setdefault((store, path), [])):
                        uids.append(other)
            return [
                Protection(CapturedItem(store=store, key=path, tree=False), tuple(uids))
                for (store, path), uids in by.items()
                if uids
            ]

    async def forget(self, capture: RunCapture) -> None:
        async with _unavailable_is_transient():
            kv = await self._bucket()
            stored = await self._get(kv, capture.uid)
            for item in {*_referenced(capture), *(_referenced(stored) if stored else ())}:
                await _purge(kv, f"ref.{digest(item)}.{capture.uid}")
                await _purge(kv, path_key(item, capture.uid))
            await _purge(kv, f"run.{capture.uid}")

    @staticmethod
    async def _get(kv: KeyValue, uid: str) -> RunCapture | None:
        try:
            entry = await kv.get(f"run.{uid}")
        except KeyNotFoundError:
            return None
        try:
            return RunCapture.model_validate_json(entry.value or b"")
        except ValidationError:
            return None  # not lapse's writing: nothing is deleted on it


def _referenced(capture: RunCapture) -> tuple[CapturedItem, ...]:
    """What the run holds: its items, ML Metadata's among them, and what ML Metadata said
    another run uses (so no other capture of the same item deletes it meanwhile)."""
    return (*capture.all_items, *(kept.item for kept in capture.kept))


async def _keys(kv: KeyValue, subject: str) -> list[str]:
    """The keys matching a subject filter (the server selects), each once: an ordered
    consumer of the last message per key, ended by the message that says no more follow
    (its own `num_pending`), or at once when the server has delivered none and has none
    to deliver. Not nats-py's `watch`: it ends on a marker it makes from the consumer's
    info, and under load that reply can overtake messages already on their way, so a key
    another run holds was missed (and what it shields could have been deleted)."""
    # What `KeyValue.watch` subscribes to: the bucket's stream and subject prefix.
    stream: str = kv._stream
    prefix: str = kv._pre
    js: JetStreamContext = kv._js
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await js.subscribe(
        prefix + subject,
        stream=stream,
        cb=arrived.put,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        headers_only=True,
        inactive_threshold=KEYS_INACTIVE,
    )
    try:
        info = await sub.consumer_info()
        found: list[str] = []
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if info.num_pending == 0 and not delivered:
            return found
        while True:
            msg = await asyncio.wait_for(arrived.get(), KEYS_TIMEOUT)
            headers = msg.headers or {}
            # A deleted or purged key leaves a marker as its last message: not a key.
            if headers.get(KV_OPERATION) is None and MARKER_REASON not in headers:
                found.append(msg.subject[len(prefix) :])
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()


async def _purge(kv: KeyValue, key: str) -> None:
    with contextlib.suppress(KeyNotFoundError):
        await kv.purge(key)
