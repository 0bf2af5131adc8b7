"""Re-deriving schedules from what exists: the backfill after installing lapse on a cluster
full of old runs, and a periodic safety net.

Two passes, each paged so memory stays flat whatever the size of the cluster or database:

1. Finished Workflows (server-side selection on Argo's `completed` label), each handed to
   the ttl-planner as a `run.finished` event, exactly as if the watcher had seen it finish.
   The planner leaves an unchanged deadline alone, so running reconcile again is harmless.
   A deadline that fired counts as unchanged only while its due message is in a reaper's
   hands: one that was handled and whose object still exists (a refused DELETE, since
   repaired) is issued again (see lapse.edges.schedules.NatsScheduleStore).
2. KFP run rows whose Workflow is gone and whose database deadline has passed. Nothing else
   would ever schedule them (the planner only hears of runs that still have an object), so
   their database deadline is decided here and scheduled through the planner, keyed by the
   KFP run id.

Reconcile only schedules. Past-due deadlines fire at once and the reapers pace the
deletions (`safety.max_deletions_per_second`, the mass-deletion brake).

Why whole Workflows and not a metadata-only list: the planner needs `status.finishedAt`,
`status.phase` and `spec.ttlStrategy`, which PartialObjectMetadata leaves out (and Argo's
printer columns, the only other projection the API server offers, carry no finishedAt);
fetching metadata first and then each object would cost one GET per run. So pages are
small and handled one at a time (with the next one prefetched), and memory is bounded by
two pages whatever the cluster holds. Where only existence matters (does a KFP run still
have a Workflow?) the list is metadata-only.
"""

from lapse.operations.reconcile.counts import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PAGE_SIZE,
    DEFAULT_ROW_PAGE_SIZE,
    NoProgress,
    Options,
    Progress,
    ReconcileError,
    ReconcileSummary,
    RowCounts,
    RunCounts,
)
from lapse.operations.reconcile.passes import Reconciler, reconcile
from lapse.operations.reconcile.planner import build_planner

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_ROW_PAGE_SIZE",
    "NoProgress",
    "Options",
    "Progress",
    "ReconcileError",
    "ReconcileSummary",
    "Reconciler",
    "RowCounts",
    "RunCounts",
    "build_planner",
    "reconcile",
]
