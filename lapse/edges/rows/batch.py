"""One transaction's ledger: its runs, what the locked reads said of each, and the rows
counted per run, from which the transaction's results are made (lapse/edges/rows/store.py).

The steps that write it, in the order a transaction runs them:
- lock each table target's parent rows that meet their run's precondition, refuse the
  others (guard.py: `lock_and_judge`);
- vouch for, lock and judge each ML Metadata run (footprints.py: `lock_and_judge_graphs`);
- delete what is left, per target (`members`, delete.py; footprints.py: `delete_footprints`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from lapse.edges.rows.delete import Normalize
from lapse.edges.rows.model import BoundTarget, PendingRun
from lapse.functions.row_reaper.mlmd import MlmdRun
from lapse.functions.row_reaper.ports import Contradicted, Counted, RunResult
from lapse.functions.row_reaper.verdict import RunFacts

Tally = dict[tuple[str, str], int]


@dataclass
class Batch:
    """What one transaction knows of its runs (positions in `runs`)."""

    conn: AsyncConnection
    runs: list[PendingRun]
    dry_run: bool
    normalize: Normalize
    tallies: list[Tally] = field(init=False)
    # Runs the database contradicted, with what it said first: they keep every row.
    refused: dict[int, Contradicted] = field(default_factory=dict)
    # Per run, targets not touched and why (ML Metadata not vouched for).
    skipped: list[dict[str, str]] = field(init=False)
    # Per target whose parent table records namespaces: the runs whose locked row names theirs.
    owned: dict[str, set[int]] = field(default_factory=dict)
    # Per ML Metadata target: the runs KFP's record vouched for, and their locked graphs.
    vouched: dict[str, list[int]] = field(default_factory=dict)
    graphs: dict[tuple[str, int], MlmdRun] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tallies = [{} for _ in self.runs]
        self.skipped = [{} for _ in self.runs]

    def keyed(self, target: BoundTarget) -> list[int]:
        """The runs with a key in `target`."""
        return [i for i, run in enumerate(self.runs) if target.spec.name in run.keys]

    def refuse(self, index: int, fact: RunFacts) -> None:
        """The run keeps every row, in every target; its first contradiction is what it
        reports."""
        self.refused.setdefault(index, Contradicted(fact))

    def members(self, target: BoundTarget) -> list[int]:
        """The runs whose rows of `target` are deleted: keyed, not refused, and for a target
        that records namespaces, owned (without that row nothing says whose the other
        tables' rows are: they count zero); for ML Metadata, vouched for."""
        if target.mlmd is not None:
            members = self.vouched.get(target.spec.name, [])
        else:
            members = self.keyed(target)
            if target.parent.namespace is not None:
                for i in members:
                    self.tallies[i] |= {(target.spec.name, step.name): 0 for step in target.steps}
                owned = self.owned.get(target.spec.name, set())
                members = [i for i in members if i in owned]
        return [i for i in members if i not in self.refused]

    def results(self) -> list[RunResult]:
        return [
            self.refused.get(i)
            or Counted(
                tuple((t, table, n) for (t, table), n in tally.items()),
                tuple(self.skipped[i].items()),
            )
            for i, tally in enumerate(self.tallies)
        ]
