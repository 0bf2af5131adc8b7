"""The artifacts target's edges: object stores through obstore (`stores.py`), each run's
capture in the NATS key-value bucket `LAPSE_ARTIFACTS` (`captures.py`), Argo's
artifact repository ConfigMaps (`repositories.py`) and what live Workflows record
(`live.py`)."""

from lapse.edges.artifacts.captures import BUCKET, NatsCaptures
from lapse.edges.artifacts.live import KubeLiveRuns, recording_kinds
from lapse.edges.artifacts.repositories import ConfigMapRepositories
from lapse.edges.artifacts.stores import ObstoreStores

__all__ = [
    "BUCKET",
    "ConfigMapRepositories",
    "KubeLiveRuns",
    "NatsCaptures",
    "ObstoreStores",
    "recording_kinds",
]
