"""The artifacts target's edges: object stores through obstore (`stores.py`), each run's
capture in the NATS key-value bucket `LAPSE_ARTIFACTS` (`captures.py`), Argo's
artifact repository ConfigMaps (`repositories.py`) and what live Workflows record
(`live.py`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lapse.edges.artifacts.captures import BUCKET, NatsCaptures
    from lapse.edges.artifacts.live import KubeLiveRuns, recording_kinds
    from lapse.edges.artifacts.repositories import ConfigMapRepositories
    from lapse.edges.artifacts.stores import ObstoreStores

# Imported on first use (PEP 562), as lapse.config is: the row-reaper and the planner use the
# captures (NATS) but not the stores, and their images carry no obstore (images/README.md).
_WHERE = {
    "BUCKET": "captures",
    "NatsCaptures": "captures",
    "KubeLiveRuns": "live",
    "recording_kinds": "live",
    "ConfigMapRepositories": "repositories",
    "ObstoreStores": "stores",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'lapse.edges.artifacts' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lapse.edges.artifacts.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BUCKET",
    "ConfigMapRepositories",
    "KubeLiveRuns",
    "NatsCaptures",
    "ObstoreStores",
    "recording_kinds",
]
