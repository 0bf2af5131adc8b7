"""The NATS trust decision (lapse/runtime/trust.py): observed only from the route's own
durable on the route's own stream, on the first delivery, with lapse's mark; and the
write side, where lapse's mark is written only for a stated `Provenance`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from lapse.edges.publishing import NatsPublisher, provenance_headers
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.observed import observed_mark
from lapse.functions.ports import ScheduleStore
from lapse.functions.trust import Provenance, Trust
from lapse.functions.ttl_planner import Planner
from lapse.operations.reconcile.planner import ReadOnlySchedules
from lapse.runtime.trust import Delivery, Source, trust_of_message, trust_of_own_read
from tests.fakes import FakeSchedules

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


def test_an_event_built_from_this_process_s_own_read_is_observed() -> None:
    assert trust_of_own_read() is Trust.OBSERVED


def test_the_mark_is_written_only_for_a_version_lapse_read() -> None:
    # The header is a public contract: stored schedules carry it across upgrades.
    assert provenance_headers(Provenance.READ_BY_LAPSE) == {"Lapse-Observed": "apiserver"}
    assert provenance_headers(Provenance.CLAIMED) == {}


@pytest.mark.parametrize("said", [True, False, "apiserver", None])
def test_anything_but_a_provenance_is_refused_where_the_mark_is_written(said: object) -> None:
    """The old `observed=True` (or a truthy anything) must not pass for either value."""
    with pytest.raises(TypeError, match="Provenance"):
        provenance_headers(said)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "writer",
    [
        ScheduleStore.put,
        NatsScheduleStore.put,
        ReadOnlySchedules.put,
        FakeSchedules.put,
        NatsPublisher.__init__,
        Planner.apply,
    ],
    ids=lambda writer: writer.__qualname__,
)
def test_every_writer_states_the_provenance_it_has_no_default(writer: Callable[..., Any]) -> None:
    """A forgotten argument is a TypeError (and a mypy error), never a belief either way;
    the old `observed=` keyword is gone."""
    parameters = inspect.signature(writer).parameters
    assert parameters["provenance"].default is inspect.Parameter.empty
    assert parameters["provenance"].annotation in (Provenance, "Provenance")
    assert "observed" not in parameters
