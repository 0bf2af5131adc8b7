"""ML Metadata's account of a KFP run's artifacts, recorded into the run's capture by the
row-reaper before it deletes the run's MLMD rows (the `MetadataRecorder` port).

The planner cannot read ML Metadata (on Knative it has no database), and the row-reaper
deletes MLMD's rows on the database clock, usually before the artifacts fall due: so the
row-reaper, which reads the run's graph with its context locked anyway, hands the
split (the URIs the run alone used, those another run still uses) to the capture in the
same step (docs/architecture.md, "The artifacts target").
"""

from __future__ import annotations

from dataclasses import dataclass

from lapse.functions.artifact_reaper.capture import with_metadata
from lapse.functions.artifact_reaper.ports import Captures
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.row_reaper.mlmd import ArtifactAccount


@dataclass(frozen=True)
class CaptureMetadata:
    """`lapse.functions.row_reaper.ports.MetadataRecorder` on the captures."""

    captures: Captures
    config: ArtifactsConfig

    async def record(self, uid: str, account: ArtifactAccount) -> None:
        """Into the run's capture; none stored (no artifacts target for the run, or its
        artifacts done already): nothing to record, and none is created (it would
        outlive every schedule)."""
        captured = await self.captures.get(uid)
        if captured is None:
            return
        await self.captures.put(
            with_metadata(captured, account.run_only, account.shared, self.config)
        )
