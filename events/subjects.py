"""NATS subjects: part of the contract, because other tools subscribe to them too."""

from __future__ import annotations

import re

from lapse.events.errors import InvalidEvent
from lapse.events.run import Target
from lapse.events.types import EventType

SCHEDULE_PREFIX = "lapse.sched"
DUE_PREFIX = "lapse.due"
EVENTS_PREFIX = "lapse.events"
# The watcher's re-list lane: what a re-list publishes again, consumed by its own durable
# consumer so that live watch events never queue behind a re-list (docs/architecture.md).
RELIST_PREFIX = "lapse.events.relist"
AUDIT_PREFIX = "lapse.audit"
DLQ_PREFIX = "lapse.dlq"

# A subject token may not contain separators, wildcards or white space; Kubernetes uids
# (UUIDs) never do, but a uid arrives from outside, so it is checked, not trusted.
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class InvalidSubjectToken(InvalidEvent, ValueError):
    """A value from an event (a uid) that cannot be a NATS subject token: bad input."""


def _token(value: str) -> str:
    if not _TOKEN.match(value):
        raise InvalidSubjectToken(f"{value!r} cannot be part of a NATS subject")
    return value


def schedule_subject(target: Target, uid: str) -> str:
    """Where the one pending schedule for (target, uid) lives: publishing replaces it."""
    return f"{SCHEDULE_PREFIX}.{target.value}.{_token(uid)}"


def due_subject(target: Target, uid: str) -> str:
    """Where the scheduler puts the due message when the deadline arrives."""
    return f"{DUE_PREFIX}.{target.value}.{_token(uid)}"


def schedule_or_due_subject(target: Target, uid: str) -> str:
    """Both of the above at once (`lapse.*.<target>.<uid>`), for reading a run's newest
    schedule state in one lookup. Holds because both prefixes are `lapse.<one token>`."""
    return f"lapse.*.{target.value}.{_token(uid)}"


def event_subject(event_type: str) -> str:
    """Ingress subject for a lifecycle event type (dots in the type become tokens)."""
    return f"{EVENTS_PREFIX}.{event_type}"


def relist_subject(event_type: str) -> str:
    """The re-list lane's subject for a lifecycle event type."""
    return f"{RELIST_PREFIX}.{event_type}"


def audit_subject(event_type: str) -> str:
    return f"{AUDIT_PREFIX}.{event_type}"


def dlq_subject(event_type: str) -> str:
    return f"{DLQ_PREFIX}.{event_type}"


# What handlers produce: stored on the audit stream.
_PRODUCED = frozenset(
    {
        EventType.CLEANUP_SCHEDULED,
        EventType.CLEANUP_CANCELLED,
        EventType.CLEANUP_COMPLETED,
        EventType.CLEANUP_FAILED,
    }
)


def subject_filter(event_type: str, target: str | None = None) -> str:
    """The NATS subject filter that carries events of this type (and target).

    Due events live on the schedule stream keyed by target; what handlers produce lives on
    the audit stream; everything else arrives through ingress.
    """
    if event_type == EventType.CLEANUP_DUE:
        return f"{DUE_PREFIX}.{target}.>" if target else f"{DUE_PREFIX}.>"
    if event_type in _PRODUCED:
        return audit_subject(event_type)
    return event_subject(event_type)
