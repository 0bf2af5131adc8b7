"""The one NATS connection helper."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext


async def connect(url: str, *, name: str = "lapse") -> NATS:
    """Connect with reconnects that never give up: a NATS restart must not end lapse."""
    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )


def max_payload(js: JetStreamContext) -> int | None:
    """The server's max_payload (headers and body of one message) from its INFO, or None
    when the context is not backed by a connected client."""
    client = getattr(js, "_nc", None)
    limit = getattr(client, "max_payload", None)
    return limit if isinstance(limit, int) and limit > 0 else None
