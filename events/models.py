"""Payload models: the `data` of every lapse CloudEvent, one model per event type.

They are the contract between functions, so they stay small and strict (camelCase on the
wire, unknown fields rejected, frozen). The JSON Schemas in `events/schemas/` are
generated from them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Final, TypeAlias

from pydantic import AwareDatetime, BeforeValidator, Field

from lapse.events.artifacts import RunArtifacts
from lapse.events.run import ContractModel, RunRef, Target
from lapse.events.types import EventType, Outcome

# What a policy string looks like is the planner's business; the contract only insists
# that something named the rule, so an audit trail can always answer "why this deadline".
PolicyName = Annotated[str, Field(min_length=1, max_length=253)]
# Reasons and details are for people reading an audit trail; an error message can be any
# length, so the contract bounds them and cuts what is longer (marked with "...").
MAX_TEXT: Final = 4096


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """`text` within `limit` characters, its end replaced by "..." when it was cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clipped(value: object) -> object:
    return clip(value) if isinstance(value, str) else value


Reason = Annotated[str, BeforeValidator(_clipped), Field(min_length=1, max_length=MAX_TEXT)]
Detail = Annotated[str, BeforeValidator(_clipped), Field(max_length=MAX_TEXT)]

MAX_ORIGINAL_ATTRIBUTES: Final = 32
MAX_ORIGINAL_VALUE_CHARS: Final = 512
MAX_ORIGINAL_DATA_CHARS: Final = 8192


class RunFinished(ContractModel):
    run: RunRef
    # Where the run's artifacts went, as the object said when it finished (Argo): the
    # planner keeps them for the artifacts target (events/artifacts.py).
    artifacts: RunArtifacts | None = None


class RunDeleted(ContractModel):
    run: RunRef


class CleanupScheduled(ContractModel):
    run: RunRef
    target: Target
    deadline: AwareDatetime
    policy: PolicyName
    # True when this schedule moved an earlier deadline for the same run and target.
    replaced: bool = False


class CleanupCancelled(ContractModel):
    run: RunRef
    target: Target
    reason: Reason


class CleanupDue(ContractModel):
    run: RunRef
    target: Target
    deadline: AwareDatetime
    policy: PolicyName
    scheduled_at: AwareDatetime


class CleanupCompleted(ContractModel):
    run: RunRef
    target: Target
    outcome: Outcome
    deadline: AwareDatetime | None = None
    completed_at: AwareDatetime
    # completedAt - deadline; negative means deleted early, which must never happen and is
    # therefore worth recording rather than clamping.
    latency_seconds: float | None = None
    detail: Detail | None = None
    dry_run: bool = False

    @classmethod
    def of(
        cls,
        *,
        run: RunRef,
        target: Target,
        outcome: Outcome,
        completed_at: datetime,
        deadline: datetime | None = None,
        detail: str | None = None,
        dry_run: bool = False,
    ) -> CleanupCompleted:
        """Build a completion with `latencySeconds` computed from the deadline."""
        latency = None if deadline is None else (completed_at - deadline).total_seconds()
        return cls(
            run=run,
            target=target,
            outcome=outcome,
            deadline=deadline,
            completed_at=completed_at,
            latency_seconds=latency,
            detail=detail,
            dry_run=dry_run,
        )


class OriginalEvent(ContractModel):
    """What a failed input looked like, bounded so one huge event cannot bloat the DLQ."""

    attributes: dict[str, Annotated[str, Field(max_length=MAX_ORIGINAL_VALUE_CHARS)]] = Field(
        default_factory=dict, max_length=MAX_ORIGINAL_ATTRIBUTES
    )
    data: str | None = Field(default=None, max_length=MAX_ORIGINAL_DATA_CHARS)
    truncated: bool = False


class CleanupFailed(ContractModel):
    # None when the input could not even be parsed into a run.
    run: RunRef | None = None
    target: Target | None = None
    reason: Reason
    # Open-ended on purpose ("adapter", "planner", "reaper", ...): handlers added later
    # report their own stage without a contract change.
    stage: Annotated[str, Field(min_length=1, max_length=63)]
    attempts: int = Field(default=1, ge=0)
    original: OriginalEvent | None = None


Payload: TypeAlias = (
    RunFinished
    | RunDeleted
    | CleanupScheduled
    | CleanupCancelled
    | CleanupDue
    | CleanupCompleted
    | CleanupFailed
)

PAYLOAD_MODELS: Final[dict[EventType, type[Payload]]] = {
    EventType.RUN_FINISHED: RunFinished,
    EventType.RUN_DELETED: RunDeleted,
    EventType.CLEANUP_SCHEDULED: CleanupScheduled,
    EventType.CLEANUP_CANCELLED: CleanupCancelled,
    EventType.CLEANUP_DUE: CleanupDue,
    EventType.CLEANUP_COMPLETED: CleanupCompleted,
    EventType.CLEANUP_FAILED: CleanupFailed,
}

EVENT_TYPES: Final[dict[type[Payload], EventType]] = {
    model: event_type for event_type, model in PAYLOAD_MODELS.items()
}


def model_for(event_type: EventType | str) -> type[Payload] | None:
    """The payload model for a CloudEvent `type`, or None if lapse does not define it."""
    try:
        return PAYLOAD_MODELS[EventType(event_type)]
    except ValueError:
        return None
