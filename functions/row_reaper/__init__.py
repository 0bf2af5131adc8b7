"""row-reaper: deletes a finished run's database rows (KFP, Argo archive, declared tables)."""

from functions.row_reaper.handler import SOURCE, BatchRetryLater, Retry, RowReaper
from functions.row_reaper.ports import Counted, Rejected, RowStore, RunResult, Unavailable
from functions.row_reaper.targets import KeySource, MissingKey, Step, TargetSpec, targets_for

__all__ = [
    "SOURCE",
    "BatchRetryLater",
    "Counted",
    "KeySource",
    "MissingKey",
    "Rejected",
    "Retry",
    "RowReaper",
    "RowStore",
    "RunResult",
    "Step",
    "TargetSpec",
    "Unavailable",
    "targets_for",
]
