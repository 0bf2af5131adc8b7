"""The safety settings the handlers act on, owned here and composed by lapse's config loader.

They are the `safety:` section of `lapse.yaml` (keys documented in lapse.example.yaml and
docs/architecture.md); the handlers receive them as values, so deciding what is safe never
depends on how the configuration was read.
"""

from __future__ import annotations

from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lapse.functions.durations import PositiveDuration


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NamespaceFilter(_Settings):
    """A namespace is handled if it matches an `include` glob and no `exclude` glob."""

    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _includes_something(self) -> NamespaceFilter:
        if not self.include:
            raise ValueError("include is empty, so no namespace would be handled (use ['*'])")
        return self


class BrakeSettings(_Settings):
    """More than `max_due` deletions due within `window` pause deletion and raise an alert."""

    enabled: bool = True
    max_due: int = Field(default=1000, ge=1)
    window: PositiveDuration = timedelta(seconds=60)


class GateRetry(_Settings):
    """Waiting for a closed gate (Argo archiving, KFP persistence, Tekton Results): retry
    every `backoff`, up to `max_wait`."""

    max_wait: PositiveDuration = timedelta(hours=1)
    backoff: PositiveDuration = timedelta(seconds=10)

    @model_validator(mode="after")
    def _backoff_fits(self) -> GateRetry:
        if self.backoff > self.max_wait:
            raise ValueError("backoff is longer than max_wait")
        return self


class SafetyConfig(_Settings):
    dry_run: bool = False
    namespaces: NamespaceFilter = NamespaceFilter()
    max_deletions_per_second: float = Field(default=50, gt=0)
    mass_deletion_brake: BrakeSettings = BrakeSettings()
    wait_for_archiving: bool = True
    wait_for_kfp_persisted: bool = True
    # Tekton Results (functions/object_reaper/gates.py): true holds every PipelineRun and
    # TaskRun until the Results watcher marks it stored; auto only those the watcher has
    # already annotated (a run it never reached is not held: set true where Results runs);
    # false never holds.
    wait_for_tekton_results: Literal["auto"] | bool = "auto"
    gate_retry: GateRetry = GateRetry()
    # auto: DELETE the version the planner read, with uid and resourceVersion preconditions,
    # GETting only when the server refuses (409) or that version may not be deleted (1
    # request a deletion), when lapse itself read that version from the API server (its
    # watcher, reconcile, a fetch); GET first otherwise (events over HTTP: an ingress, the
    # Knative Broker). true: always GET first (2 requests). false: never GET first, trusting
    # whatever sent the run event (docs/architecture.md, "How a deletion is made safe").
    read_before_delete: Literal["auto"] | bool = "auto"


def out_of_scope(namespace: str, scope: NamespaceFilter) -> str | None:
    """Why lapse must not touch `namespace`, or None when it may: step 2 of every
    reaper's sequence (functions/reaping/sequence.py), before anything is read."""
    excluded = next((p for p in scope.exclude if fnmatchcase(namespace, p)), None)
    if excluded is not None:
        return f"namespace {namespace!r} is excluded by safety.namespaces.exclude {excluded!r}"
    if not any(fnmatchcase(namespace, p) for p in scope.include):
        return f"namespace {namespace!r} matches no safety.namespaces.include pattern"
    return None
