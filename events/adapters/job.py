"""Kubernetes batch/v1 Jobs (read by `lapse.events.kinds.JOB`)."""

from __future__ import annotations

from typing import Final

from lapse.events.adapters.objects import adapt
from lapse.events.adapters.result import Ignored
from lapse.events.kinds import JOB
from lapse.events.models import RunDeleted, RunFinished

GROUP: Final = JOB.group
KIND: Final = JOB.kind


def adapt_job(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """A Job object -> RunFinished (Complete/Failed condition True), RunDeleted, Ignored.

    The finishing condition's `lastTransitionTime` is the finish (what the Kubernetes
    TTL-after-finished controller counts from); `status.completionTime` if it is absent.
    A Job controlled by another object (a CronJob) is left to its owner.
    """
    return adapt(obj, JOB, deleted)
