"""Whose deletion a gone object is (issue 37): a DELETE lapse sent whose answer it never
heard (the store carried it out, then answered after the client's timeout) leaves the
object gone at the next look. Without a record the next delivery would call it
`already_gone` and the run would never say `deleted`, though lapse deleted it.

The rule, stated once: an object found gone is lapse's own deletion when lapse sent a
DELETE for exactly that object (store, key and the etag it listed) before this pass, as
lapse's stored record says; any other object found gone is someone else's (`already_gone`).
The record (`SentBatch`) is written to lapse's capture bucket just before a batch's
DELETEs go (lapse/edges/artifacts/captures.py), so it survives a redelivery and a restart,
and a tenant cannot write it. Only records from earlier passes count: an object this
pass's own DELETE found gone (404) was answered, and it was not lapse's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TypeAlias

from lapse.functions.artifact_reaper.ports import SentBatch, StoredObject

# (store, key, etag): one object as lapse listed it and sent its DELETE.
Mark: TypeAlias = tuple[str, str, str | None]


def sent_marks(sent: Iterable[SentBatch]) -> frozenset[Mark]:
    return frozenset((batch.store, obj.path, obj.etag) for batch in sent for obj in batch.objects)


def lapses_own(store: str, gone: StoredObject, sent: Collection[Mark]) -> bool:
    """Whether an object found gone is lapse's own deletion: lapse sent a DELETE for this
    very object (same key, same etag) in an earlier pass (`sent`: `sent_marks`)."""
    return (store, gone.path, gone.etag) in sent


def gone_since_sent(
    sent: Sequence[SentBatch], there: Iterable[tuple[str, str]]
) -> tuple[SentBatch, ...]:
    """The sent objects not there now (`there`: (store, key) of what this look found),
    each once: lapse's own deletions whose answer may never have come."""
    present = set(there)
    seen: set[Mark] = set()
    found: list[SentBatch] = []
    for batch in sent:
        objects = []
        for obj in batch.objects:
            mark = (batch.store, obj.path, obj.etag)
            if (batch.store, obj.path) not in present and mark not in seen:
                seen.add(mark)
                objects.append(obj)
        if objects:
            found.append(SentBatch(batch.store, tuple(objects)))
    return tuple(found)
