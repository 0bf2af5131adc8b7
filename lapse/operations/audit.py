"""Reading what lapse recorded: the audit trail (as rows for people and scripts) and the
pending schedules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext

from lapse.edges.fleet_streams import FLEET_AUDIT, cluster_of, fleet_subject
from lapse.edges.schedules import SCHEDULE_HEADER
from lapse.edges.streams import SUBJECT_HEADER, count_messages, read_stream
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupCompleted, CleanupFailed
from lapse.events.nats_binding import decode_header_value, from_nats
from lapse.events.run import Target
from lapse.events.subjects import AUDIT_PREFIX, SCHEDULE_PREFIX
from lapse.events.timeutil import format_rfc3339, parse_rfc3339
from lapse.events.types import EventType


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


async def fleet_audit_events(
    js: JetStreamContext,
    *,
    cluster: str | None = None,
    since: datetime | None = None,
) -> AsyncIterator[tuple[str, BaseCloudEvent]]:
    """(cluster, event) for every outcome, schedule and cancellation the hub sourced from
    its clusters (or from `cluster` only), oldest first as the hub stored them; the
    cluster is the one the hub's subject names, which only that cluster's leaf identity
    can deliver (docs/fleet.md)."""
    subject = f"{fleet_subject(cluster or '*', 'audit')}.>"
    async for _, headers, body in read_stream(
        js, FLEET_AUDIT, subject, since=since, with_subject=True
    ):
        named = cluster_of(headers.pop(SUBJECT_HEADER, ""))
        if named is None:
            continue
        try:
            yield named, from_nats(headers, body)
        except InvalidEvent:
            continue  # not written by lapse


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


# The events that end a due deadline: what `history` and `status` show by default.
OUTCOME_TYPES = (EventType.CLEANUP_COMPLETED, EventType.CLEANUP_FAILED)


def history_row(event: BaseCloudEvent) -> dict[str, Any] | None:
    """One audit event as a flat row (time, run, target, outcome, lateness, detail); None
    for an event whose payload is not lapse's."""
    try:
        payload = parse_payload(event)
    except InvalidEvent:
        return None
    run = getattr(payload, "run", None)
    time = event.get_time()
    row: dict[str, Any] = {
        "time": format_rfc3339(time) if time else None,
        "event": str(event.get_type()).removeprefix("dev.lapse.").removesuffix(".v1"),
        "namespace": run.namespace if run else None,
        "name": run.name if run else None,
        "uid": run.uid if run else None,
        "target": getattr(payload, "target", None),
        "outcome": None,
        "deadline": None,
        "latencySeconds": None,
        "detail": None,
        "source": event.get_source(),
    }
    if isinstance(payload, CleanupCompleted):
        row["outcome"] = payload.outcome.value
        row["deadline"] = format_rfc3339(payload.deadline) if payload.deadline else None
        row["latencySeconds"] = payload.latency_seconds
        row["detail"] = payload.detail
    elif isinstance(payload, CleanupFailed):
        row["outcome"] = "failed"
        row["detail"] = payload.reason
    else:
        deadline = getattr(payload, "deadline", None)
        row["deadline"] = format_rfc3339(deadline) if deadline else None
        row["detail"] = getattr(payload, "policy", None) or getattr(payload, "reason", None)
    if row["target"] is not None:
        row["target"] = str(row["target"])
    return row
