"""What a run object says of its artifacts in object storage, as read when it finished.

The run object is gone by the time its artifacts fall due (they are the `artifacts`
target, on their own clock), so the planner captures them from the finished run and keeps
the list beside the schedule (docs/architecture.md, "The artifacts target"). Today Argo
Workflows (and KFP v1/v2 runs, which are Workflows) say where their output artifacts
went: `status.nodes[*].outputs.artifacts[*]`, including the archived `main-logs`, and the
repository those keys live in (`status.artifactRepositoryRef`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lapse.events.run import ContractModel

Provider = Literal["s3", "gcs", "azure"]


class StoredArtifact(ContractModel):
    """One artifact's location: the object `key` (a file, or a directory's prefix) in
    `bucket` (an Azure container). `bucket` None: the run's artifact repository's, named by
    `RunArtifacts.repository` (a ConfigMap the planner reads)."""

    provider: Provider
    bucket: str | None = Field(default=None, min_length=1)
    key: str = Field(min_length=1, max_length=1024)
    endpoint: str | None = None


class RepositoryRef(ContractModel):
    """Argo's `status.artifactRepositoryRef`: the ConfigMap key holding the repository."""

    namespace: str = Field(min_length=1)
    config_map: str = Field(min_length=1)
    key: str | None = None  # the ConfigMap's annotated default key when None


class RunArtifacts(ContractModel):
    """The artifacts a finished run recorded. `collected_by_engine` says why the engine
    deletes them itself (Argo's artifactGC): lapse then leaves them to it."""

    artifacts: tuple[StoredArtifact, ...] = ()
    repository: RepositoryRef | None = None
    collected_by_engine: str | None = Field(default=None, max_length=512)
