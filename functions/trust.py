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

What lapse writes says the other half, as a `Provenance`: whether the object version a
schedule or run event carries is one lapse itself read from the API server. It is not a
`Trust`: a writer knows where its content came from, not how it will be delivered, and a
version lapse read is still a `CLAIM` when it is redelivered or arrives over HTTP. Every
writer states it (no default): a forgotten argument is a type error, never a belief.
"""

from __future__ import annotations

from enum import Enum


class Trust(Enum):
    OBSERVED = "observed"
    CLAIM = "claim"

    @property
    def observed(self) -> bool:
        return self is Trust.OBSERVED


class Provenance(Enum):
    """Where the object version a message lapse writes carries came from.

    - `READ_BY_LAPSE`: lapse itself read it from the API server (its watcher, `lapse
      reconcile`, the planner's fetch, a reaper's GET). The message is marked so
      (events/observed.py), which makes it `Trust.OBSERVED` only when lapse's own durable
      delivers it, the first time (lapse/runtime/trust.py).
    - `CLAIMED`: anything else (an event someone sent, a version judged as an event carried
      it without a read): the message is not marked.
    """

    READ_BY_LAPSE = "read_by_lapse"
    CLAIMED = "claimed"
