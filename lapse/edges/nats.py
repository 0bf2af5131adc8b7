"""The one NATS connection helper."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NATS


async def connect(url: str, *, name: str = "lapse") -> NATS:
    """Connect with reconnects that never give up: a NATS restart must not end lapse."""
    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )
