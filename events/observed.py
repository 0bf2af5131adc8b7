"""Which events describe an object version lapse itself read from the API server.

A run event or a due event carries an object version (its annotations, resourceVersion).
When lapse read that version from the API server itself (its watcher, `lapse reconcile`,
a planner fetch, a reaper's GET), a reaper may judge that version and DELETE it held to its
resourceVersion, with no GET first (`safety.read_before_delete: auto`). When the event came
from anywhere else (an HTTP ingress, the Knative Broker), its content is a claim and the
object is read before it is judged (docs/architecture.md, "How a deletion is made safe").

The mark travels in two forms:
- between lapse's own processes, as the NATS header `Lapse-Observed` on the messages only
  lapse writes (the watcher's run events, the planner's and the reaper's schedules; the
  server copies a schedule's headers onto its due message);
- inside a process, as the CloudEvent extension `lapseobserved`, which the runtime sets
  from that header on a message's first delivery (a redelivered one may have been acted on
  already) and removes from everything that arrives over HTTP. An extension in an incoming
  event is therefore never believed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.v1.event import CloudEvent

OBSERVED_EXTENSION: Final = "lapseobserved"
OBSERVED_HEADER: Final = "Lapse-Observed"
API_SERVER: Final = "apiserver"


def is_observed(event: BaseCloudEvent) -> bool:
    """Whether the runtime marked this event as describing a version lapse read itself."""
    return event.get_attributes().get(OBSERVED_EXTENSION) == API_SERVER


def marked(event: BaseCloudEvent, observed: bool) -> BaseCloudEvent:
    """The event with the mark set (observed) or removed (not)."""
    attributes = dict(event.get_attributes())
    if observed:
        if attributes.get(OBSERVED_EXTENSION) == API_SERVER:
            return event
        attributes[OBSERVED_EXTENSION] = API_SERVER
    elif attributes.pop(OBSERVED_EXTENSION, None) is None:
        return event
    return CloudEvent(attributes=attributes, data=event.get_data())


def header_says_observed(headers: Mapping[str, str] | None) -> bool:
    """The NATS header form of the mark (only lapse's own publishers write it)."""
    return (headers or {}).get(OBSERVED_HEADER) == API_SERVER


def observed_headers(event: BaseCloudEvent) -> dict[str, str]:
    """The header to publish with `event`: the mark, if it carries it."""
    return {OBSERVED_HEADER: API_SERVER} if is_observed(event) else {}
