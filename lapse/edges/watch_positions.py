"""Where each kind's watch resumes after a restart: the `LAPSE_WATCH` key-value bucket.

One key per configured kind (its name). The value is a resourceVersion up to which every
event of that kind is stored in NATS: the watcher writes it only after the publishes for
that version were acknowledged, and never while a re-list is still publishing (the list's
objects are not all stored yet), so a crash at any moment resumes at or before the last
stored event and never skips one. Resuming repeats at most the last second's events,
which the event ids (`<uid>.<resourceVersion>.<type>`) let JetStream drop as duplicates.

The value also names the API server it came from (its URL): a resourceVersion means
nothing to another cluster, so a position stored for one is not used for another (lapse
then lists, as with nothing stored). The bucket keeps one revision per key and no TTL: a
position is only ever replaced.
"""

from __future__ import annotations

import contextlib
import json
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError

from lapse.edges.nats import LazyBucket

BUCKET: Final = "LAPSE_WATCH"


class WatchPositions:
    """The stored watch position per kind; the bucket is made on first use."""

    def __init__(self, js: JetStreamContext, *, replicas: int = 1) -> None:
        self._bucket = LazyBucket(
            js,
            KeyValueConfig(
                bucket=BUCKET,
                description="Where each kind's watch resumes (lapse up's watcher)",
                history=1,
                replicas=replicas,
            ),
        )

    async def get(self, kind: str, cluster: str) -> str | None:
        """The resourceVersion stored for `kind` on `cluster` (the API server's URL), or
        None: never stored, forgotten, or stored for another cluster."""
        kv = await self._bucket()
        try:
            entry = await kv.get(kind)
        except KeyNotFoundError:  # also a deleted or purged key
            return None
        try:
            value = json.loads(entry.value or b"{}")
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("cluster") != cluster:
            return None
        version = value.get("resourceVersion")
        return version if isinstance(version, str) and version else None

    async def put(self, kind: str, cluster: str, resource_version: str) -> None:
        value = {"cluster": cluster, "resourceVersion": resource_version}
        await (await self._bucket()).put(kind, json.dumps(value).encode())

    async def forget(self, kind: str) -> None:
        """Make the next start of `kind`'s watch list everything again."""
        kv = await self._bucket()
        with contextlib.suppress(KeyNotFoundError):
            await kv.purge(kind)
