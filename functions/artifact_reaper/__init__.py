"""artifact-reaper: deletes a finished run's artifacts and logs in object storage, on the
artifacts clock, from what lapse captured when it planned the run."""

from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture, capture, render
from lapse.functions.artifact_reaper.handler import SOURCE, ArtifactReaper
from lapse.functions.artifact_reaper.ports import (
    Captures,
    ObjectStores,
    RepositoryReader,
    StoredObject,
)
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore

__all__ = [
    "SOURCE",
    "ArtifactReaper",
    "ArtifactStore",
    "ArtifactsConfig",
    "CapturedItem",
    "Captures",
    "ObjectStores",
    "RepositoryReader",
    "RunCapture",
    "StoredObject",
    "capture",
    "render",
]
