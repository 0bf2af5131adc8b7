"""Function names are a public contract: a former name still runs, with a warning."""

from __future__ import annotations

import logging

import pytest

from lapse.runtime.registry import FUNCTIONS, RENAMED, current_name


def test_the_workflow_reaper_is_now_the_object_reaper(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert current_name("workflow-reaper") == "object-reaper"
    assert "now called 'object-reaper'" in caplog.text
    assert all(new in FUNCTIONS for new in RENAMED.values())


def test_current_names_pass_through_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert [current_name(n) for n in FUNCTIONS] == list(FUNCTIONS)
    assert caplog.text == ""
