"""The outcome events a reaper makes (`cleanup.completed`, `cleanup.failed`): one shape for
every target, each carrying the trace context it is made in (`creation_context`).

The ids are set at the reaper's one exit (`lapse.events.builder.as_outcome_of`): derived from the
due event's, so a redelivery that ends the same way is a duplicate the audit stream drops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import build_event
from lapse.events.models import CleanupCompleted, CleanupFailed, OriginalEvent
from lapse.events.run import RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.functions.tracing import creation_context


@dataclass(frozen=True)
class Outcomes:
    """The outcome events of one reaper (`source`, `stage`) for one `target`."""

    source: str
    target: Target
    stage: str
    clock: Callable[[], datetime]

    def completed(
        self,
        run: RunRef,
        outcome: Outcome,
        deadline: datetime,
        detail: str,
        *,
        dry_run: bool = False,
    ) -> BaseCloudEvent:
        data = CleanupCompleted.of(
            run=run,
            target=self.target,
            outcome=outcome,
            completed_at=self.clock(),
            deadline=deadline,
            detail=detail,
            dry_run=dry_run,
        )
        return build_event(
            EventType.CLEANUP_COMPLETED, source=self.source, data=data, **creation_context()
        )

    def failed(
        self,
        run: RunRef | None,
        reason: str,
        original: OriginalEvent | None = None,
        *,
        stage: str | None = None,
    ) -> BaseCloudEvent:
        """A refusal: nothing was deleted. `run` is None when the input named none."""
        data = CleanupFailed(
            run=run,
            target=self.target if run is not None else None,
            reason=reason,
            stage=stage or self.stage,
            original=original,
        )
        return build_event(
            EventType.CLEANUP_FAILED, source=self.source, data=data, **creation_context()
        )
