"""The NATS header by which lapse's own publishers say "lapse read this version itself".

A run event or a due event carries an object version (its annotations, resourceVersion).
When lapse read that version from the API server itself (its watcher, `lapse reconcile`,
a planner fetch, a reaper's GET), the message lapse publishes says so in the header
`Lapse-Observed: apiserver` (the server copies a schedule's headers onto its due message).

The header alone proves nothing: it is believed only on a message that lapse's own
durable consumer delivered from the stream it reads (the message's JetStream metadata,
which the server writes), on subjects NATS lets nobody but lapse's own identities publish
on (docs/security.md, "NATS identities"); the runtime turns the two into the typed fact a
handler is handed (`functions/trust.py`, decided in `lapse/runtime/trust.py` only). It
never travels inside a CloudEvent: whatever arrives over HTTP, marked or not, is a claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent

OBSERVED_HEADER: Final = "Lapse-Observed"
API_SERVER: Final = "apiserver"
# The CloudEvent attribute the mark once travelled in inside a process. Nothing believes it
# any more; a sender who writes it is claiming, and the ingress drops it (`unclaimed`).
OBSERVED_EXTENSION: Final = "lapseobserved"


def header_says_observed(headers: Mapping[str, str] | None) -> bool:
    """Whether a message carries the mark (lapse's own publishers write it; whether it is
    believed is lapse/runtime/trust.py's to say, from where the message came from)."""
    return (headers or {}).get(OBSERVED_HEADER) == API_SERVER


def observed_mark() -> dict[str, str]:
    """The header to publish with a message that describes a version lapse read itself
    (which messages do is the writer's `Provenance`: lapse/edges/publishing.py)."""
    return {OBSERVED_HEADER: API_SERVER}


def unclaimed(event: BaseCloudEvent) -> BaseCloudEvent:
    """The event without the attribute a sender may write to claim lapse's mark."""
    attributes = dict(event.get_attributes())
    if attributes.pop(OBSERVED_EXTENSION, None) is None:
        return event
    return CloudEvent(attributes=attributes, data=event.get_data())
