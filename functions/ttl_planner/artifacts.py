"""The planner's part of the artifacts target: capturing what belongs to a run in object
storage when it is planned (the object is gone by the time its artifacts are due).

The capture itself is pure (functions/artifact_reaper/capture.py); this adds the one read
it may need, an Argo artifact repository's ConfigMap, for recorded artifacts that name no
bucket, and stores the result beside the schedule (the `Captures` port).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from lapse.events.artifacts import Provider, RunArtifacts
from lapse.events.kinds import KindSet
from lapse.events.run import RunRef
from lapse.functions.artifact_reaper.capture import RunCapture, capture
from lapse.functions.artifact_reaper.ports import Captures, RepositoryReader
from lapse.functions.artifact_reaper.stores import ArtifactsConfig


@dataclass(frozen=True)
class ArtifactPlanning:
    config: ArtifactsConfig
    captures: Captures
    repositories: RepositoryReader | None = None

    async def capture(self, run: RunRef, recorded: RunArtifacts | None, kinds: KindSet) -> None:
        """Capture the run's artifacts and store the capture (replacing an earlier one)."""
        await self.captures.put(await self._captured(run, recorded, kinds))

    async def keep(self, run: RunRef, recorded: RunArtifacts | None, kinds: KindSet) -> None:
        """A run whose artifacts are kept: the keys it recorded are stored once, so another
        run that shares one (a cached output) never takes it. Only recorded keys: a declared
        prefix is the run's own (it names its uid or name), and a kept run's capture stays
        for as long as the bucket does."""
        if recorded is None or not recorded.artifacts:
            return
        if await self.captures.get(run.uid) is None:
            captured = await self._captured(run, recorded, kinds)
            if any(not item.tree for item in captured.items):
                await self.captures.put(captured)

    async def _captured(
        self, run: RunRef, recorded: RunArtifacts | None, kinds: KindSet
    ) -> RunCapture:
        repository: dict[Provider, str] = {}
        ref = recorded.repository if recorded else None
        if ref is not None and self.repositories is not None:
            buckets = await self.repositories.buckets(ref.namespace, ref.config_map, ref.key)
            repository = {cast(Provider, k): v for k, v in buckets.items()}
        kind = kinds.of(run.api_version, run.kind).name
        return capture(run, kind, recorded, self.config, repository)
