"""Durations accept ASCII digits only: what Go and kubectl parse, nothing they refuse."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from lapse.events.run import Target
from lapse.functions.durations import DurationError, parse_duration, parse_ttl
from lapse.functions.policy import TTL_ANNOTATION, Action, decide
from tests.unit.test_policy import make_run

NON_ASCII = [
    "\uff15s",  # fullwidth 5
    "\u0665s",  # Arabic-Indic 5
    "1\u0669m",  # Arabic-Indic 9 after an ASCII digit
    "\u0967h",  # Devanagari 1
]


@pytest.mark.parametrize("text", NON_ASCII)
def test_non_ascii_digits_are_refused(text: str) -> None:
    with pytest.raises(DurationError):
        parse_duration(text)
    with pytest.raises(DurationError):
        parse_ttl(text)


@pytest.mark.parametrize("text", NON_ASCII)
def test_non_ascii_ttl_annotation_never_leads_to_a_deletion(text: str) -> None:
    run = make_run(annotations={TTL_ANNOTATION: text})
    decision = decide(run, Target.KUBERNETES, [], datetime(2027, 1, 1, tzinfo=UTC))
    assert decision.action is Action.INVALID
    assert decision.deadline is None
