"""Where each entrance decides what its handler may believe: the one place `Trust` is set.

- NATS (`lapse up`'s dispatcher, the bridge's source): a message is `OBSERVED` only when
  where it came from says so, never its content alone. Its JetStream metadata (the reply
  subject `$JS.ACK.<stream>.<consumer>.<delivered>...`, which the server sets and no
  publisher can) must name the stream the route reads and the route's own durable
  consumer, which only lapse's identity may create or update (docs/security.md, "NATS
  identities"); it must be the first delivery; and lapse's publisher must have marked it as
  describing a version lapse read from the API server (`events/observed.py`). A message
  any other consumer delivered (a push consumer someone pointed at lapse's inbox), or one
  with no metadata at all, is a `CLAIM` however it is marked. A redelivery is a `CLAIM`
  too: an earlier delivery may have acted already (a process killed after its DELETE,
  before its ack), and a fresh read then finds the object gone instead of sending a second
  DELETE.
- HTTP (the Knative function shell, the ingress): always `CLAIM`. Whatever a request says
  of itself, including a `ce-lapseobserved` attribute or a `Lapse-Observed` header, is
  content, not provenance.
- In process (the policy watcher's re-plans, `lapse reconcile`'s pass over listed runs):
  an event this process built from an object it has just read from the API server and
  hands to a handler itself, with nothing in between, is `OBSERVED` (`trust_of_own_read`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lapse.events.observed import header_says_observed
from lapse.functions.trust import Trust


@dataclass(frozen=True)
class Delivery:
    """Where a NATS message came from, as its JetStream metadata says (None: it has none,
    so it was not delivered by a JetStream consumer)."""

    stream: str
    consumer: str
    delivered: int


@dataclass(frozen=True)
class Source:
    """Where a route's messages must come from to be believed: its stream, its durable."""

    stream: str
    consumer: str


def trust_of_message(
    headers: Mapping[str, str] | None, delivery: Delivery | None, source: Source
) -> Trust:
    """The trust of a NATS message a route consuming from `source` was handed."""
    if delivery is None or not header_says_observed(headers):
        return Trust.CLAIM
    own = delivery.stream == source.stream and delivery.consumer == source.consumer
    if own and delivery.delivered == 1:
        return Trust.OBSERVED
    return Trust.CLAIM


def trust_of_request() -> Trust:
    """The trust of anything that arrived over HTTP."""
    return Trust.CLAIM


def trust_of_own_read() -> Trust:
    """The trust of an event this process built from an object it read from the API server
    and handed straight to a handler (no message, no request: nobody else could write it)."""
    return Trust.OBSERVED
