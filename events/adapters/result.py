"""What an adapter can conclude about one input besides a normalized run event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from lapse.events.models import RunDeleted, RunFinished


@dataclass(frozen=True, slots=True)
class Ignored:
    """Valid input that needs no action (a run still going, an unrelated Kubernetes Event).

    Distinct from `InvalidEvent` so that the normal chatter of a cluster never reaches the
    dead-letter queue.
    """

    reason: str


@dataclass(frozen=True, slots=True)
class NeedsFetch:
    """The input only names the object; the I/O edge must GET it and call `adapt_object`.

    `deleted` means the object is already gone (a GET will 404): the edge reports the run
    deleted by what it knows, it cannot fetch it.
    """

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str | None = None
    deleted: bool = False


AdapterResult: TypeAlias = RunFinished | RunDeleted | Ignored | NeedsFetch
