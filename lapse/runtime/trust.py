"""Where each entrance decides what its handler may believe: the one place `Trust` is set.

- NATS (`lapse up`'s dispatcher, the bridge's source): a message lapse's own publishers
  marked as describing a version lapse read from the API server (`events/observed.py`),
  delivered for the first time, is `OBSERVED`. The mark is believed because only lapse's
  identities may publish on the subjects the dispatcher consumes (docs/security.md). A
  redelivery is a `CLAIM`: an earlier delivery may have acted already (a process killed
  after its DELETE, before its ack), and a fresh read then finds the object gone instead
  of sending a second DELETE.
- HTTP (the Knative function shell, the ingress): always `CLAIM`. Whatever a request says
  of itself, including a `ce-lapseobserved` attribute or a `Lapse-Observed` header, is
  content, not provenance.
"""

from __future__ import annotations

from collections.abc import Mapping

from lapse.events.observed import header_says_observed
from lapse.functions.trust import Trust


def trust_of_message(headers: Mapping[str, str] | None, delivery: int) -> Trust:
    """The trust of a NATS message on one of lapse's own subjects, on its `delivery`-th
    delivery (1 for the first)."""
    if header_says_observed(headers) and delivery <= 1:
        return Trust.OBSERVED
    return Trust.CLAIM


def trust_of_request() -> Trust:
    """The trust of anything that arrived over HTTP."""
    return Trust.CLAIM
