"""The NATS trust decision (lapse/runtime/trust.py): observed only from the route's own
durable on the route's own stream, on the first delivery, with lapse's mark."""

from __future__ import annotations

import pytest

from lapse.events.observed import observed_mark
from lapse.functions.trust import Trust
from lapse.runtime.trust import Delivery, Source, trust_of_message

SOURCE = Source(stream="LAPSE_SCHED", consumer="lapse-object-reaper-due")
MARK = observed_mark()


def test_lapses_own_first_delivery_with_the_mark_is_observed() -> None:
    own = Delivery("LAPSE_SCHED", "lapse-object-reaper-due", delivered=1)
    assert trust_of_message(MARK, own, SOURCE) is Trust.OBSERVED


@pytest.mark.parametrize(
    ("headers", "delivery"),
    [
        # Another stream's consumer pushed it into lapse's inbox (issue 36).
        (MARK, Delivery("LAPSE_AUDIT", "forger", delivered=1)),
        # Another stream, a consumer named like lapse's durable.
        (MARK, Delivery("LAPSE_AUDIT", "lapse-object-reaper-due", delivered=1)),
        # The right stream, someone else's consumer.
        (MARK, Delivery("LAPSE_SCHED", "lapse-bridge-due", delivered=1)),
        # Published straight into the inbox: no JetStream metadata at all.
        (MARK, None),
        # A redelivery: an earlier delivery may have acted.
        (MARK, Delivery("LAPSE_SCHED", "lapse-object-reaper-due", delivered=2)),
        # Lapse's own, unmarked.
        ({}, Delivery("LAPSE_SCHED", "lapse-object-reaper-due", delivered=1)),
        (None, Delivery("LAPSE_SCHED", "lapse-object-reaper-due", delivered=1)),
    ],
)
def test_anything_else_is_a_claim(
    headers: dict[str, str] | None, delivery: Delivery | None
) -> None:
    assert trust_of_message(headers, delivery, SOURCE) is Trust.CLAIM
