"""Where each running lapse says what it is waiting out, for `lapse status` to show.

A JetStream key-value bucket (`LAPSE_HEALTH`): one key per process, holding, per function,
how long it has been waiting out a transient failure, how many events wait, and why. The
bucket forgets a key a minute after its last write, so a process that died takes its
report with it; a live one writes every few seconds while it waits, and once when the wait
is over.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, NoKeysError
from nats.js.kv import KeyValue

BUCKET: Final = "LAPSE_HEALTH"
KEEP_SECONDS: Final = 60.0


@dataclass(frozen=True)
class Waiting:
    """One function of one process waiting out a transient failure."""

    process: str
    function: str
    seconds: float
    events: int
    reason: str


def process_key() -> str:
    """This process, as a key: host and pid (a pod's name is its host name)."""
    return f"{socket.gethostname()}-{os.getpid()}".replace(".", "_")


async def bucket(js: JetStreamContext, *, replicas: int = 1) -> KeyValue:
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=BUCKET,
                description="What each lapse process is waiting out (lapse status)",
                ttl=KEEP_SECONDS,
                replicas=replicas,
            )
        )


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
        entry = await kv.get(key)
        for function, item in json.loads(entry.value or b"{}").items():
            found.append(
                Waiting(key, function, float(item["seconds"]), int(item["events"]), item["reason"])
            )
    return found
