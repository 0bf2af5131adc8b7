"""The ASGI types lapse's two HTTP entry points share (the ingress and the Knative function
shell), and their one way to answer with a status and a line of text."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def respond(send: Send, status: int, text: str, *, retry_after: float | None = None) -> None:
    """A plain-text answer; `retry_after` (seconds, rounded up to at least 1) tells a sender
    that retries (the Knative Broker) when to come back."""
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the server's lifespan messages (nothing to set up or tear down)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
