"""Where each running lapse says what it is waiting out, for `lapse status` to show.

A JetStream key-value bucket (`LAPSE_HEALTH`): one key per process, holding, per function,
how long it has been waiting out a transient failure, how many events wait, and why; and,
per background task (a watcher, the policy watcher: lapse.runtime.supervisor), what it is
waiting out, since when and when it tries next (wall-clock times, so a reader on another
host says "next try in" from its own clock). The
bucket forgets a key a minute after its last write, so a process that died takes its
report with it; a live one writes every few seconds while it waits, and once when the wait
is over.

A re-list in progress (the watcher listing a kind after 410 Gone or a first start) is a key
of its own, `relist.<process>.<kind>`, with how far it is; it is removed when the re-list
ends (and forgotten a minute after a process that died mid-way).

The safety net (the Knative shape's periodic reconcile, lapse/operations/reconcile/
periodic.py) keeps its last pass under `reconcile.<process>`, written again while the
process lives. Its body is shaped like a process report with no events waiting, so a
`lapse status` that predates it shows nothing for it rather than failing.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from lapse.edges.nats import key_value_bucket

BUCKET: Final = "LAPSE_HEALTH"
KEEP_SECONDS: Final = 60.0
RELIST_PREFIX: Final = "relist."
RECONCILE_PREFIX: Final = "reconcile."
_NET: Final = "reconcile"


@dataclass(frozen=True)
class Waiting:
    """One function of one process waiting out a transient failure."""

    process: str
    function: str
    seconds: float
    events: int
    reason: str


@dataclass(frozen=True)
class TaskWait:
    """What a background task waits out: why, since when, its next try (epoch seconds)."""

    reason: str
    since: float
    next_try: float


@dataclass(frozen=True)
class TaskWaiting:
    """One background task of one process waiting out a fault."""

    process: str
    task: str
    wait: TaskWait


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


async def report(
    kv: KeyValue,
    key: str,
    waiting: dict[str, tuple[float, int, str]],
    tasks: dict[str, TaskWait] | None = None,
) -> None:
    """Write this process's report: function -> (seconds, events waiting, reason), and
    background task -> what it waits out."""
    body: dict[str, dict[str, object]] = {
        f: {"seconds": s, "events": n, "reason": r} for f, (s, n, r) in waiting.items()
    }
    for task, wait in (tasks or {}).items():
        # A task's entry reads as a function's with no events to a `lapse status` that
        # predates tasks (it shows only entries with events), so it is skipped there.
        body[task] = {"seconds": 0, "events": 0, "reason": wait.reason, "task": True,
                      "since": wait.since, "nextTry": wait.next_try}  # fmt: skip
    await kv.put(key, json.dumps(body).encode())


async def _reports(js: JetStreamContext) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    try:
        kv = await js.key_value(BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return []
    found = []
    for key in keys:
        if key.startswith((RELIST_PREFIX, RECONCILE_PREFIX)):
            continue
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # its process ended meanwhile
            continue
        found.append((key, json.loads(entry.value or b"{}")))
    return found


async def read(js: JetStreamContext) -> list[Waiting]:
    """Every live process's functions' waits; empty when nothing waits (or no lapse ever
    reported)."""
    return [
        Waiting(key, function, float(item["seconds"]), int(item["events"]), str(item["reason"]))
        for key, body in await _reports(js)
        for function, item in body.items()
        if not item.get("task")
    ]


async def read_tasks(js: JetStreamContext) -> list[TaskWaiting]:
    """Every live process's background tasks waiting out a fault."""
    return [
        TaskWaiting(
            key,
            task,
            TaskWait(str(item["reason"]), float(item["since"]), float(item["nextTry"])),
        )
        for key, body in await _reports(js)
        for task, item in body.items()
        if item.get("task")
    ]


async def report_relist(kv: KeyValue, progress: Relisting) -> None:
    body = {"listed": progress.listed, "published": progress.published, "seconds": progress.seconds}
    await kv.put(relist_key(progress.process, progress.kind), json.dumps(body).encode())


async def relist_over(kv: KeyValue, process: str, kind: str) -> None:
    await kv.delete(relist_key(process, kind))


async def _entries(js: JetStreamContext, prefix: str) -> AsyncIterator[tuple[str, Any]]:
    """(key without `prefix`, its JSON) for every live key under `prefix`."""
    try:
        kv = await js.key_value(BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return
    for key in keys:
        if not key.startswith(prefix):
            continue
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # ended meanwhile
            continue
        yield key.removeprefix(prefix), json.loads(entry.value or b"{}")


async def read_relists(js: JetStreamContext) -> list[Relisting]:
    """Every re-list running now, in any live process."""
    found = []
    async for name, item in _entries(js, RELIST_PREFIX):
        process, _, kind = name.partition(".")
        found.append(
            Relisting(
                process, kind, int(item["listed"]), int(item["published"]), float(item["seconds"])
            )
        )
    return found


def reconcile_key(process: str) -> str:
    return f"{RECONCILE_PREFIX}{process}"


async def report_reconcile(kv: KeyValue, process: str, last_pass: dict[str, Any]) -> None:
    """Write the safety net's last pass (`PassReport.as_json`) under this process."""
    body = {_NET: {"seconds": 0, "events": 0, "reason": "", "pass": last_pass}}
    await kv.put(reconcile_key(process), json.dumps(body).encode())


async def read_reconciles(js: JetStreamContext) -> list[tuple[str, dict[str, Any]]]:
    """Every live safety net's last pass: (process, what `report_reconcile` wrote)."""
    found = []
    async for process, body in _entries(js, RECONCILE_PREFIX):
        item = body.get(_NET) or {}
        if isinstance(item.get("pass"), dict):
            found.append((process, item["pass"]))
    return found
