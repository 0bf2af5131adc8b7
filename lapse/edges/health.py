"""Where each running lapse says what it is waiting out, for `lapse status` to show.

A JetStream key-value bucket (`LAPSE_HEALTH`): one key per process, holding, per function,
how long it has been waiting out a transient failure, how many events wait, and why. The
bucket forgets a key a minute after its last write, so a process that died takes its
report with it; a live one writes every few seconds while it waits, and once when the wait
is over.

A re-list in progress (the watcher listing a kind after 410 Gone or a first start) is a key
of its own, `relist.<process>.<kind>`, with how far it is; it is removed when the re-list
ends (and forgotten a minute after a process that died mid-way).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from lapse.edges.nats import key_value_bucket

BUCKET: Final = "LAPSE_HEALTH"
KEEP_SECONDS: Final = 60.0
RELIST_PREFIX: Final = "relist."


@dataclass(frozen=True)
class Waiting:
    """One function of one process waiting out a transient failure."""

    process: str
    function: str
    seconds: float
    events: int
    reason: str


@dataclass(frozen=True)
class Relisting:
    """One kind being listed again by one process: how far it is."""

    process: str
    kind: str
    listed: int  # objects read from the API server so far
    published: int  # of those, published again (the others were unchanged or unfinished)
    seconds: float


def relist_key(process: str, kind: str) -> str:
    return f"{RELIST_PREFIX}{process}.{kind}"


def process_key() -> str:
    """This process, as a key: host and pid (a pod's name is its host name)."""
    return f"{socket.gethostname()}-{os.getpid()}".replace(".", "_")


async def bucket(js: JetStreamContext, *, replicas: int = 1) -> KeyValue:
    config = KeyValueConfig(
        bucket=BUCKET,
        description="What each lapse process is waiting out (lapse status)",
        ttl=KEEP_SECONDS,
        replicas=replicas,
    )
    return await key_value_bucket(js, config)


async def report(kv: KeyValue, key: str, waiting: dict[str, tuple[float, int, str]]) -> None:
    """Write this process's report: function -> (seconds, events waiting, reason)."""
    body = {f: {"seconds": s, "events": n, "reason": r} for f, (s, n, r) in waiting.items()}
    await kv.put(key, json.dumps(body).encode())


async def read(js: JetStreamContext) -> list[Waiting]:
    """Every live process's waits; empty when nothing waits (or no lapse ever reported)."""
    try:
        kv = await js.key_value(BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return []
    found = []
    for key in keys:
        if key.startswith(RELIST_PREFIX):
            continue
        entry = await kv.get(key)
        for function, item in json.loads(entry.value or b"{}").items():
            found.append(
                Waiting(key, function, float(item["seconds"]), int(item["events"]), item["reason"])
            )
    return found


async def report_relist(kv: KeyValue, progress: Relisting) -> None:
    body = {"listed": progress.listed, "published": progress.published, "seconds": progress.seconds}
    await kv.put(relist_key(progress.process, progress.kind), json.dumps(body).encode())


async def relist_over(kv: KeyValue, process: str, kind: str) -> None:
    await kv.delete(relist_key(process, kind))


async def read_relists(js: JetStreamContext) -> list[Relisting]:
    """Every re-list running now, in any live process."""
    try:
        kv = await js.key_value(BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return []
    found = []
    for key in keys:
        if not key.startswith(RELIST_PREFIX):
            continue
        process, _, kind = key.removeprefix(RELIST_PREFIX).partition(".")
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # ended meanwhile
            continue
        item = json.loads(entry.value or b"{}")
        found.append(
            Relisting(
                process, kind, int(item["listed"]), int(item["published"]), float(item["seconds"])
            )
        )
    return found
