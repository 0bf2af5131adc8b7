"""Reading what lapse recorded: the audit trail, pending schedules, dead letters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events.errors import InvalidEvent
from events.nats_binding import decode_header_value, from_nats
from events.run import Target
from events.subjects import AUDIT_PREFIX, SCHEDULE_PREFIX
from events.timeutil import parse_rfc3339
from lapse.edges.bus import SCHEDULE_HEADER


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


async def audit_events(
    js: JetStreamContext,
    stream: str,
    *,
    event_type: str | None = None,
    since: datetime | None = None,
    start_seq: int | None = None,
) -> AsyncIterator[BaseCloudEvent]:
    subject = f"{AUDIT_PREFIX}.{event_type}" if event_type else f"{AUDIT_PREFIX}.>"
    async for _, headers, body in read_stream(
        js, stream, subject, since=since, start_seq=start_seq
    ):
        try:
            yield from_nats(headers, body)
        except InvalidEvent:
            continue  # not written by lapse; the audit view shows lapse's own events


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


@dataclass(frozen=True)
class PendingSummary:
    target: Target
    count: int
    next_deadlines: list[tuple[datetime, str]]  # (deadline, "<namespace>/<name>"), earliest first
    scanned: int  # how many schedules the next deadlines were chosen from


async def pending_schedules(
    js: JetStreamContext, stream: str, target: Target, *, scan_limit: int = 100_000, show: int = 5
) -> PendingSummary:
    subject = f"{SCHEDULE_PREFIX}.{target.value}.>"
    count = await count_messages(js, stream, subject)
    earliest: list[tuple[datetime, str]] = []
    scanned = 0
    async for _, headers, _ in read_stream(
        js, stream, subject, headers_only=True, limit=scan_limit
    ):
        scanned += 1
        spec = headers.get(SCHEDULE_HEADER, "")
        if spec.startswith("@at "):
            run = decode_header_value(headers.get("ce-subject", ""))
            earliest.append((parse_rfc3339(spec[4:]), run))
            if len(earliest) > show * 20:
                earliest = sorted(earliest)[:show]
        await asyncio.sleep(0)
    return PendingSummary(target, count, sorted(earliest)[:show], scanned)
