"""notify-on-cleanup: one line per `dev.lapse.cleanup.completed.v1` on standard output.

A stand-in for a real notifier (a chat message, a ticket, an artifact cleaner): replace
`notify` with what your team needs. The Trigger (trigger.yaml) sends only cleanup.completed
events here; anything else is answered 400 so a wrong Trigger shows at once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("notify-on-cleanup")

COMPLETED = "dev.lapse.cleanup.completed.v1"


def notify(event_id: str, data: dict[str, Any]) -> str:
    """The line this example writes for one outcome (what a notifier would send)."""
    run = data.get("run", {})
    return (
        f"cleanup.completed id={event_id} outcome={data.get('outcome')} "
        f"target={data.get('target')} run={run.get('namespace')}/{run.get('name')} "
        f"uid={run.get('uid')} latency={data.get('latencySeconds')}"
    )


async def _answer(send: Any, status: int, body: str = "") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [[b"content-type", b"text/plain"]]})  # fmt: skip
    await send({"type": "http.response.body", "body": body.encode()})


class Notifier:
    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        event = scope["event"]
        raw = getattr(send, "http", send)  # func-python's sender; .http takes ASGI messages
        if event.get_type() != COMPLETED:
            await _answer(raw, 400, f"not {COMPLETED}: {event.get_type()}")
            return
        data = event.get_data()
        if isinstance(data, bytes | str):
            data = json.loads(data)
        # print, not only logging: the line is what `kubectl logs` shows, flushed at once.
        print(notify(str(event.get_id()), data), flush=True)
        await _answer(raw, 202)

    def alive(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


def new() -> Notifier:
    return Notifier()
