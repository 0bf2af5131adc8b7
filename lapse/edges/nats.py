"""The one NATS connection helper, and the JetStream streams lapse needs."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import nats
import yaml
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

import infra
from lapse.config import Streams

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


async def connect(url: str, *, name: str = "lapse") -> NATS:
    """Connect with reconnects that never give up: a NATS restart must not end lapse."""
    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )


def _seconds(value: str | int | float) -> float:
    if isinstance(value, int | float):
        return float(value)
    return float(value[:-1]) * _SECONDS[value[-1]]


def due_message_ttl() -> float:
    """Seconds a fired due message is kept (handled or not) before the server removes it."""
    return _seconds(_definitions()["schedule"].get("due_message_ttl", "7d"))


@functools.cache
def _definitions() -> dict[str, dict[str, Any]]:
    streams: dict[str, dict[str, Any]] = yaml.safe_load(infra.read_text("nats/streams.yaml"))[
        "streams"
    ]
    return streams


def stream_configs(
    names: Streams | None = None, *, replicas: int = 1, audit_max_age: timedelta | None = None
) -> list[StreamConfig]:
    names = names or Streams()
    configs = []
    for key, spec in _definitions().items():
        max_age: str | float = spec.get("max_age", 0)
        if key == "audit" and audit_max_age is not None:
            max_age = audit_max_age.total_seconds()
        configs.append(
            StreamConfig(
                name=getattr(names, key),
                description=spec.get("description"),
                subjects=list(spec["subjects"]),
                storage=StorageType(spec.get("storage", "file")),
                max_age=_seconds(max_age),
                num_replicas=replicas,
                allow_msg_schedules=bool(spec.get("allow_msg_schedules")) or None,
                allow_msg_ttl=bool(spec.get("allow_msg_ttl")) or None,
                # Publishers set Nats-Msg-Id to the CloudEvent id: duplicates within this
                # window are dropped by the server.
                duplicate_window=120.0,
            )
        )
    return configs


async def ensure_streams(js: JetStreamContext, configs: list[StreamConfig]) -> list[str]:
    """Create each stream or update it in place. Returns what was done, one line each."""
    done = []
    for cfg in configs:
        try:
            await js.stream_info(cfg.name or "")
        except NotFoundError:
            await js.add_stream(cfg)
            done.append(f"created {cfg.name}")
        else:
            await js.update_stream(cfg)
            done.append(f"updated {cfg.name}")
    return done
