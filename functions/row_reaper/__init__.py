"""row-reaper: deletes a finished run's database rows (KFP, Argo archive, declared tables)."""

from lapse.functions.row_reaper.handler import SOURCE, RowReaper
from lapse.functions.row_reaper.ports import (
    Contradicted,
    Counted,
    Rejected,
    RowStore,
    RunResult,
    RunRows,
    Unavailable,
)
from lapse.functions.row_reaper.targets import KeySource, MissingKey, Step, TargetSpec, targets_for

__all__ = [
    "SOURCE",
    "Contradicted",
    "Counted",
    "KeySource",
    "MissingKey",
    "Rejected",
    "RowReaper",
    "RowStore",
    "RunResult",
    "RunRows",
    "Step",
    "TargetSpec",
    "Unavailable",
    "targets_for",
]
