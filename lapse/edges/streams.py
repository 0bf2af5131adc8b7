"""The JetStream streams lapse needs: their definitions (infra/nats/streams.yaml), creating
or updating them, and reading them without a durable consumer (audit, counts)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import yaml
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Placement,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from lapse import infra
from lapse.config import ConfigError, NatsConfig, Streams
from lapse.config.schema import StreamPlacement
from lapse.functions.durations import parse_duration


def _seconds(value: str | int | float) -> float:
    """A definition's duration: a number of seconds, or text such as `7d` (one parser)."""
    if isinstance(value, int | float):
        return float(value)
    return parse_duration(value, what="streams.yaml duration").total_seconds()


def due_message_ttl() -> float:
    """Seconds a fired due message is kept (handled or not) before the server removes it."""
    return _seconds(_definitions()["schedule"].get("due_message_ttl", "7d"))


@functools.cache
def _definitions() -> dict[str, dict[str, Any]]:
    streams: dict[str, dict[str, Any]] = yaml.safe_load(infra.read_text("nats/streams.yaml"))[
        "streams"
    ]
    return streams


def configured_streams(nats: NatsConfig) -> list[StreamConfig]:
    """The streams as `nats:` configures them: names, replicas, placement, audit retention
    (what `lapse infra apply` and `lapse up` create or update)."""
    return stream_configs(
        nats.streams,
        replicas=nats.replicas,
        placement=nats.placement,
        audit_max_age=nats.audit_max_age,
    )


def stream_configs(
    names: Streams | None = None,
    *,
    replicas: int = 1,
    placement: StreamPlacement | None = None,
    audit_max_age: timedelta | None = None,
) -> list[StreamConfig]:
    names = names or Streams()
    where = None
    if placement is not None and (placement.cluster or placement.tags):
        where = Placement(cluster=placement.cluster, tags=list(placement.tags) or None)
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
                placement=where,
                allow_msg_schedules=bool(spec.get("allow_msg_schedules")) or None,
                allow_msg_ttl=bool(spec.get("allow_msg_ttl")) or None,
                allow_direct=bool(spec.get("allow_direct")) or None,
                # Publishers set Nats-Msg-Id to the CloudEvent id: duplicates within this
                # window are dropped by the server.
                duplicate_window=120.0,
            )
        )
    return configs


# JetStream's error codes for a stream it cannot place as asked.
NO_SUITABLE_PEERS = 10005
INSUFFICIENT_RESOURCES = 10023


class StreamRefused(ConfigError):
    """NATS refused a stream definition (400): the configuration must change."""


async def ensure_streams(js: JetStreamContext, configs: list[StreamConfig]) -> list[str]:
    """Create each stream or update it in place (a changed replica count or placement is
    applied by the servers). Returns what was done, one line each; a definition the servers
    refuse raises `StreamRefused` naming the keys to change."""
    done = []
    for cfg in configs:
        try:
            try:
                await js.stream_info(cfg.name or "")
            except NotFoundError:
                await js.add_stream(cfg)
                done.append(f"created {cfg.name}")
            else:
                await js.update_stream(cfg)
                done.append(f"updated {cfg.name}")
        except BadRequestError as exc:
            raise StreamRefused([_refusal(cfg, exc)]) from None
    return done


def _refusal(cfg: StreamConfig, exc: BadRequestError) -> str:
    reason = exc.description or str(exc)
    if exc.err_code in (NO_SUITABLE_PEERS, INSUFFICIENT_RESOURCES):
        where = cfg.placement
        wanted = f"{cfg.num_replicas} replica(s)"
        if where is not None:
            wanted += f" on servers with cluster={where.cluster} tags={where.tags or []}"
        return (
            f"nats.replicas, nats.placement: the NATS servers cannot hold stream {cfg.name} "
            f"with {wanted} ({reason}); a stream needs as many servers as replicas, each "
            "matching the placement"
        )
    return f"nats: the NATS server refused stream {cfg.name} ({reason})"


async def read_stream(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    start_seq: int | None = None,
    since: datetime | None = None,
    headers_only: bool = False,
    limit: int | None = None,
) -> AsyncIterator[tuple[int, dict[str, str], bytes]]:
    """Every message on `subject` stored now, oldest first, without creating a durable
    consumer; stops at what was the last message when it started."""
    info = await js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0:
        return
    extra: dict[str, Any] = {}
    if start_seq is not None:
        policy, extra["opt_start_seq"] = DeliverPolicy.BY_START_SEQUENCE, max(start_seq, 1)
    elif since is not None:
        policy, extra["opt_start_time"] = DeliverPolicy.BY_START_TIME, since.isoformat()
    else:
        policy = DeliverPolicy.ALL
    config = ConsumerConfig(
        filter_subject=subject,
        deliver_policy=policy,
        ack_policy=AckPolicy.NONE,
        headers_only=headers_only or None,
        inactive_threshold=30.0,
        **extra,
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    seen = 0
    try:
        while limit is None or seen < limit:
            try:
                msgs = await sub.fetch(500, timeout=1.0)
            except TimeoutError:
                return
            for msg in msgs:
                seq = msg.metadata.sequence.stream if msg.metadata else 0
                yield seq, dict(msg.headers or {}), msg.data
                seen += 1
                if seq >= last or (limit is not None and seen >= limit):
                    return
    finally:
        await sub.unsubscribe()


async def count_messages(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages match `subject`, counted by the server (no messages are read)."""
    sub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=ConsumerConfig(
            filter_subject=subject, ack_policy=AckPolicy.NONE, inactive_threshold=10.0
        ),
    )
    try:
        info = await sub.consumer_info()
        return int(info.num_pending or 0)
    finally:
        await sub.unsubscribe()
