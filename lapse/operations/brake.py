"""The mass-deletion brake, as an operator moves it (`lapse brake status|engage|release`,
here or sent from the fleet's hub): one line per target said the same way everywhere."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final, Literal

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lapse.config import LapseConfig
from lapse.edges.limits import SCOPES, engage, engaged, limits_bucket, release

BrakeAction = Literal["status", "engage", "release"]
BRAKE_ACTIONS: Final = ("status", "engage", "release")


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


async def move_brake(
    js: JetStreamContext,
    config: LapseConfig,
    action: BrakeAction,
    target: str | None,
    *,
    seconds: float | None = None,
) -> dict[str, str]:
    """target -> what `action` found or did, for `target` (None: every target)."""
    window = config.safety.mass_deletion_brake.window.total_seconds()
    kv = await limits_bucket(js, window=window, replicas=config.nats.replicas)
    now = datetime.now(UTC).timestamp()
    said = {}
    for name in [target] if target else list(SCOPES):
        scope = SCOPES[name]
        if action == "release":
            said[name] = await _release(kv, scope, now)
        elif action == "engage":
            pause = await engage(kv, scope, now=now, seconds=seconds or window)
            said[name] = f"engaged until {_when(pause.until)}"
        else:
            said[name] = await _status(kv, scope, now)
    return said


async def _release(kv: KeyValue, scope: str, now: float) -> str:
    was = await release(kv, scope)
    if was is None or was.until <= now:
        return "brake was not engaged; counts reset"
    return f"released (engaged since {_when(was.since)}, until {_when(was.until)})"


async def _status(kv: KeyValue, scope: str, now: float) -> str:
    current, _ = await engaged(kv, scope)
    if current is None or current.until <= now:
        return "not engaged"
    return f"engaged since {_when(current.since)}, until {_when(current.until)}"
