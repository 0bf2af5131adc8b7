"""What a handler may believe of the event it is handed: a typed fact the runtime decides.

A handler never decides trust from the event's own content, which anyone who can reach an
entrance may write. The runtime that delivered the event says where it came from, in one
place each (`lapse/runtime/trust.py`), and hands the handler a `Trust`
(docs/security.md, "What each entrance believes"):

- `OBSERVED`: the event describes an object version lapse itself read from the API server
  (its watcher, `lapse reconcile`, the planner's fetch, a reaper's GET), it came from a NATS
  subject that only lapse's own identities may publish on, and this is its first delivery
  (a redelivered one may already have been acted on). A reaper may judge that version and
  DELETE it held to its resourceVersion without reading it again; the planner may plan it
  as it is.
- `CLAIM`: anything else: an HTTP POST (the ingress, the Knative Broker), a replay, a
  redelivery. Its content is a claim: the planner reads the object before planning, the
  object-reaper reads it before judging, the row-reaper proves the deadline from the
  schedule lapse stored and from the database.

The default everywhere is `CLAIM`: forgetting to say is never a reason to believe.
"""

from __future__ import annotations

from enum import Enum


class Trust(Enum):
    OBSERVED = "observed"
    CLAIM = "claim"

    @property
    def observed(self) -> bool:
        return self is Trust.OBSERVED
