"""A read-only command waits out a NATS that briefly answers "unavailable" (a server
restarting, a stream leader being elected), and fails at once on anything else. The
failure is raised by a stand-in: a real JetStream answers 503 only for a moment during an
election (tests/e2e/test_nats_cluster.py meets it), which cannot be provoked on cue."""

from __future__ import annotations

import pytest
from nats.js.errors import ServiceUnavailableError

from lapse.cli import common
from lapse.cli.common import read_waiting_out_nats


async def test_unavailable_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def no_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(common.asyncio, "sleep", no_sleep)
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ServiceUnavailableError()
        return "report"

    assert await read_waiting_out_nats(read) == "report"
    assert calls == 3 and slept == [1.0, 1.0]


async def test_other_errors_and_a_lasting_outage_are_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no_sleep(seconds: float) -> None:
        return None

    monkeypatch.setattr(common.asyncio, "sleep", no_sleep)

    async def broken() -> str:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await read_waiting_out_nats(broken)

    async def down() -> str:
        raise ServiceUnavailableError()

    with pytest.raises(ServiceUnavailableError):
        await read_waiting_out_nats(down)
