"""CloudEvent `type` values lapse emits, and the outcomes a cleanup can report."""

from __future__ import annotations

from enum import StrEnum


class EventType(StrEnum):
    RUN_FINISHED = "dev.lapse.run.finished.v1"
    RUN_DELETED = "dev.lapse.run.deleted.v1"
    CLEANUP_SCHEDULED = "dev.lapse.cleanup.scheduled.v1"
    CLEANUP_CANCELLED = "dev.lapse.cleanup.cancelled.v1"
    CLEANUP_DUE = "dev.lapse.cleanup.due.v1"
    CLEANUP_COMPLETED = "dev.lapse.cleanup.completed.v1"
    CLEANUP_FAILED = "dev.lapse.cleanup.failed.v1"


class Outcome(StrEnum):
    """What happened to one target when its deadline came (`cleanup.completed`)."""

    DELETED = "deleted"
    ALREADY_GONE = "already_gone"
    DRY_RUN = "dry_run"
    KEPT = "kept"
    RESCHEDULED = "rescheduled"
    # The name now belongs to a different object (uid changed): it is never touched.
    REPLACED = "replaced"
    # Outside lapse's namespace scope (safety.namespaces): not read, not touched.
    SKIPPED = "skipped"
    # The due event is not backed by what lapse stored (forged, or stale): nothing deleted.
    REFUSED = "refused"
