"""The artifact reaper's judgements (pure): which captured items may be deleted now, and
which listed objects belong to an item.

The reaper cannot read the run object (it is gone by the time its artifacts are due), so
it believes nothing a due event says: the deadline and the run are the stored schedule's
(`prove`, the stored-schedule proof every reaper of a gone run shares:
functions/reaping/stored.py), the items are the capture lapse stored when it
planned the run, and every item is judged again here, before any delete, against the
configuration the reaper runs with:

- its store is configured (a store removed since is not deleted in);
- its key is a clean path (no empty, '.' or '..' parts, no leading '/') under the store's
  prefix root;
- the store serves the run's namespace and kind, and the key is the run's own: inside one
  of the store's roots rendered from the run's identity, or a declared capture rendered
  from it (ownership.py): a key a tenant wrote into a run's status is never believed;
- it has at least the store's `min_prefix_depth` parts (`logs/a/` has 2);
- no other run still references it (`shared`: another pending run captured the same item,
  or ML Metadata said another run uses it: `RunCapture.kept`, never deleted, and nothing
  listed under it either, `shielded`); what other runs record near it, captured or live,
  is kept when listed (`ownership.guarded`, `owned`).

A KFP run's artifacts due before ML Metadata's account was recorded (the artifacts clock
earlier than the database clock, or its rows kept) wait for it (`awaits_metadata`), then
give up loudly: the account is what says which objects under the run's prefix a later run
still uses.

An object listed under an item is deleted only if it is the item's own key or lies under
it (`belongs`): a listing of `runs/a` also returns `runs/ab`, which is another run's. Just
before a batch is deleted its keys are listed again; one whose size or etag differs from
the listing judged (`changed`) means the whole judgement is made again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, TypeAlias

from lapse.events.run import RunRef
from lapse.functions.artifact_reaper.capture import CapturedItem, KeptItem, RunCapture
from lapse.functions.artifact_reaper.ownership import Protection, guarded, unowned
from lapse.functions.artifact_reaper.ports import StoredObject
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.ports import PendingSchedule
from lapse.functions.safety import GateRetry

# How long after the database deadline a KFP run's artifacts wait for ML Metadata's
# account: the row-reaper records it when it handles that deadline, within seconds.
METADATA_GRACE: Final = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class Allowed:
    item: CapturedItem


@dataclass(frozen=True, slots=True)
class Disallowed:
    """Not this run's to delete (or not deletable as configured): said in the outcome."""

    item: CapturedItem
    reason: str


@dataclass(frozen=True, slots=True)
class Shared:
    item: CapturedItem
    by: tuple[str, ...]  # the other runs' uids


Judgement: TypeAlias = Allowed | Disallowed | Shared


def depth(key: str) -> int:
    """How many '/'-separated parts a key or prefix has (`logs/a/` and `logs/a` have 2)."""
    return len([part for part in key.split("/") if part])


def judge(
    item: CapturedItem,
    config: ArtifactsConfig,
    sharers: tuple[str, ...],
    run: RunRef,
    kind: str | None,
) -> Judgement:
    """May `item` be deleted now, for `run` (the stored schedule's) of kind `kind` (the
    capture's)? `sharers`: other runs whose capture holds the same item."""
    store = config.store(item.store)
    if store is None:
        return Disallowed(item, f"store {item.store!r} is not configured (artifacts.stores)")
    parts = item.key.split("/")
    inner = parts[:-1] if item.tree else parts
    if item.key.startswith("/") or any(part in ("", ".", "..") for part in inner):
        return Disallowed(item, f"{item.key!r} is not a clean key (empty, '.' or '..' parts)")
    if item.tree and not item.key.endswith("/"):
        return Disallowed(item, f"prefix {item.key!r} does not end in '/'")
    if not item.key.startswith(store.root):
        return Disallowed(item, f"{item.key!r} is outside the store's root {store.url}")
    if depth(item.key) < store.min_prefix_depth:
        return Disallowed(
            item,
            f"{item.key!r} has {depth(item.key)} parts, fewer than the store's "
            f"min_prefix_depth {store.min_prefix_depth}",
        )
    if (why := unowned(item, store, run, kind)) is not None:
        return Disallowed(item, why)
    if sharers:
        return Shared(item, sharers)
    return Allowed(item)


def belongs(item: CapturedItem, path: str) -> bool:
    """Whether a listed object is the item's: under the prefix, or the key or under `key/`."""
    if item.tree:
        return path.startswith(item.key)
    return path == item.key or path.startswith(item.key + "/")


def shielded(store: str, path: str, kept: Sequence[KeptItem]) -> bool:
    """Whether a listed object is (under) an item another run still uses."""
    return any(k.item.store == store and belongs(k.item, path) for k in kept)


Listing: TypeAlias = Sequence[tuple[CapturedItem, Sequence[StoredObject]]]


def owned(
    listed: Listing, kept: Sequence[KeptItem], protections: Sequence[Protection]
) -> tuple[dict[str, list[StoredObject]], list[Protection]]:
    """Of what was listed under each allowed item: the objects per store, each once, that
    belong to it and to nothing another run still uses; and the protections that kept
    something (or a whole item: a key another run records above it)."""
    found: dict[str, dict[str, StoredObject]] = {}
    guarding: list[Protection] = []
    for item, objects in listed:
        above = guarded(item.store, item.key.rstrip("/"), protections)
        if above is not None and above not in guarding:
            guarding.append(above)
        for obj in objects:
            if not belongs(item, obj.path) or shielded(item.store, obj.path, kept):
                continue
            if (keeps := guarded(item.store, obj.path, protections)) is not None:
                if keeps not in guarding:
                    guarding.append(keeps)
                continue
            found.setdefault(item.store, {})[obj.path] = obj
    return {store: list(objects.values()) for store, objects in found.items()}, guarding


def changed(judged: Sequence[StoredObject], now: Sequence[StoredObject]) -> list[str]:
    """The paths of the judged objects that are there now with another size or etag (a
    new object under the same key). One gone since is not changed: deleting it is a no-op."""
    current = {obj.path: obj for obj in now}
    return [
        obj.path
        for obj in judged
        if (is_now := current.get(obj.path)) is not None
        and (is_now.size != obj.size or is_now.etag != obj.etag)
    ]


@dataclass(frozen=True, slots=True)
class NotRecorded:
    """ML Metadata's account is not recorded yet: again at `until`."""

    until: datetime


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Waited long enough: nothing is deleted, and that is said loudly."""

    reason: str


def awaits_metadata(
    run: RunRef,
    captured: RunCapture,
    database: PendingSchedule | None,
    now: datetime,
    retry: GateRetry,
) -> NotRecorded | GiveUp | None:
    """Whether a KFP run's artifacts wait for ML Metadata's account (None: they go on).

    They wait until just after the run's database deadline (when the row-reaper records
    the account); still without one (its rows kept because MLMD says a task runs, or the
    row-reaper waiting out its database), every `retry.backoff` up to `retry.max_wait`
    past that deadline, then give up loudly, as a closed gate does. Without a database
    schedule there is no account to wait for."""
    if run.kfp_run_id is None or captured.metadata is not None or database is None:
        return None
    first = database.deadline + METADATA_GRACE
    if now < first:
        return NotRecorded(first)
    if now < database.deadline + retry.max_wait:
        return NotRecorded(now + retry.backoff)
    return GiveUp(
        f"ML Metadata's account of the run's artifacts was not recorded within "
        f"{retry.max_wait} of its database deadline (its rows kept, or not deleted yet); "
        "nothing was deleted: replay this once the run's rows are deleted"
    )
