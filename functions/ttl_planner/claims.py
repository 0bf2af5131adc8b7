"""A claim that a run object was deleted, judged from what lapse stored and what the API
server says (docs/security.md, "What each handler believes").

A deletion claim (a `run.deleted` over HTTP or replayed, an ApiServerSource `ref.delete`)
would withdraw the object's deadline, so it is believed only when the API server confirms
that the object with that uid is gone. Which object that is comes from the schedule lapse
stored for the uid, never from the claim: a claim that names an existing object's uid under
another name (one that does not exist, or holds another object) must not be confirmed by
the absence of the name it chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lapse.events.run import RunRef
from lapse.functions.ports import PendingSchedule


@dataclass(frozen=True, slots=True)
class Refusal:
    """The deletion is not confirmed: nothing is withdrawn, and this is recorded."""

    reason: str


def where_to_read(
    uid: str, stored: PendingSchedule | None, claimed: RunRef | None
) -> RunRef | Refusal | None:
    """The object to read to confirm that `uid` was deleted: the run lapse stored the
    Kubernetes schedule of `uid` for. With nothing stored there is nothing to withdraw; the
    claim's own object is read then, so that a claim the API server contradicts is still
    recorded. None: nothing stored and nothing named, so nothing to read or withdraw."""
    if stored is None:
        return claimed
    if stored.due is None or stored.due.run.uid != uid:
        # A schedule whose content lapse cannot read back says nothing of where the object
        # lives; the claim's own name would be the forger's choice.
        return Refusal(
            f"lapse cannot read back which object it stored the schedule of uid {uid} for"
        )
    return stored.due.run


def judge_deletion(
    uid: str, read_at: RunRef, claimed: RunRef | None, obj: Mapping[str, Any] | None
) -> Refusal | None:
    """Whether the API server's answer `obj` (a GET of `read_at`, None for 404) confirms
    that the object with `uid` is gone: None if it does (nothing there, or another uid under
    the name now), the refusal otherwise."""
    if obj is None:
        return None
    metadata = obj.get("metadata")
    found = metadata.get("uid") if isinstance(metadata, Mapping) else None
    if found is not None and found != uid:
        return None  # the name was taken again: the object with `uid` is gone
    named = ""
    if claimed is not None and (claimed.namespace, claimed.name) != (
        read_at.namespace,
        read_at.name,
    ):
        named = f" (the claim named {claimed.subject}, lapse stored it as {read_at.subject})"
    if found is None:
        return Refusal(
            f"the API server's answer for {read_at.kind} {read_at.subject} names no uid, "
            f"so it does not confirm that uid {uid} is gone{named}"
        )
    return Refusal(f"{read_at.kind} {read_at.subject} (uid {uid}) still exists{named}")
