"""Keep the last N runs of a group: the counting, pure (no I/O, no clock).

A policy's `keep_last` clause (functions/policy.py) names a group (`group_by`: a label, a
field of the object, or `auto`: the first of the engines' own labels the run carries) and
how many of its newest finished runs stay: `succeeded` and `failed` apiece, or `total`.
Every other run of the group is counted out: due at the moment the run that pushed it out
finished (so the deadline is the same whoever counts, and whenever), or earlier if its TTL
says so; never before the floor a LapsePolicy's count holds (functions/policy.py:
`count_deadline`).

What is counted is what the caller listed from the API server a moment ago: the objects
that exist now, never runs already deleted. Runs being deleted (`deletionTimestamp`),
runs that are not finished and pinned runs (`lapse.dev/keep: "true"`, or a malformed
`lapse.dev/*` annotation, which never deletes) do not count: a pinned run never costs the
group one of its N, and is never counted out.

Why this is right under concurrency (docs/architecture.md, "Keep the last N"): the runs
counted out of a listing are exactly those with at least N newer unpinned runs of their
bucket in it. Deleting such a run never takes one of the N newest, and a newer finish only
adds newer runs, so a run counted out of any listing made since stays counted out of the
group as it is now, whoever deletes first, in whatever order: the N newest stay.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from lapse.events.adapters import Ignored
from lapse.events.adapters.objects import adapt
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import KindSpec
from lapse.events.models import RunFinished
from lapse.events.run import RunRef

AUTO: Final = "auto"
# `group_by: auto` groups a run by the first of these labels it carries: the engines' own
# word for "runs of the same thing". Argo puts the first two on the Workflows a
# CronWorkflow or a WorkflowTemplate submits, KFP's ScheduledWorkflow controller the third
# on the runs of a recurring run, Tekton the last on a Pipeline's PipelineRuns.
WELL_KNOWN_GROUP_LABELS: Final = (
    "workflows.argoproj.io/cron-workflow",
    "scheduledworkflows.kubeflow.org/scheduledWorkflowName",
    "workflows.argoproj.io/workflow-template",
    "tekton.dev/pipeline",
)
SUCCEEDED: Final = "Succeeded"

# A label key as Kubernetes accepts it: an optional DNS-subdomain prefix and a name.
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_NEWEST: Final = datetime.max.replace(tzinfo=UTC)

# A field path: dot-separated names (`spec.workflowTemplateRef.name`), and a map key that
# holds dots or slashes (an annotation's) in brackets and quotes:
# `metadata.annotations['pipelines.kubeflow.org/run_name']`.
_NAME = r"[A-Za-z0-9_-]+"
_QUOTED = r"\['([^'\]\s]+)'\]|\[\"([^\"\]\s]+)\"\]"
_SEGMENT = re.compile(rf"(?:^|\.)({_NAME})|{_QUOTED}")
MAX_FIELD_DEPTH: Final = 16


@functools.lru_cache(maxsize=256)
def parse_field_path(path: str) -> tuple[str, ...]:
    """The keys of a field path, outermost first; ValueError when it is not one."""
    keys: list[str] = []
    at = 0
    while at < len(path):
        found = _SEGMENT.match(path, at)
        if found is None:
            raise ValueError(
                f"{path!r} is not a field path (dot-separated names, e.g. "
                "spec.workflowTemplateRef.name; a key with dots in brackets: "
                "metadata.annotations['example.com/key'])"
            )
        keys.append(next(g for g in found.groups() if g is not None))
        at = found.end()
    if not keys or path.startswith("."):
        raise ValueError(f"{path!r} is not a field path (it names no field, or starts with a dot)")
    if len(keys) > MAX_FIELD_DEPTH:
        raise ValueError(f"{path!r} is deeper than {MAX_FIELD_DEPTH} fields")
    return tuple(keys)


def field_value(obj: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """The group key at `keys` in an object as the API server returned it: a non-empty
    string, or an integer as its digits; None when the field is missing or holds anything
    else (a map, a list, a boolean: no group)."""
    value: Any = obj
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and value else None


def _group_by(value: str) -> str:
    if value == AUTO:
        return value
    how, sep, key = value.partition(":")
    if how == "field" and sep:
        parse_field_path(key)
        return value
    if how != "label" or not sep or not _LABEL_KEY.fullmatch(key):
        raise ValueError(
            f"{value!r} is not a group (auto, label:<key> with a label key, or field:<path>)"
        )
    return value


Count = Annotated[int, Field(ge=0)]


class KeepLast(BaseModel):
    """How many of a group's newest finished runs stay: `succeeded` and `failed` apiece
    (a bucket left unset is not counted), or `total` over both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_by: Annotated[str, AfterValidator(_group_by)] = AUTO
    succeeded: Count | None = None
    failed: Count | None = None
    total: Count | None = None

    @model_validator(mode="after")
    def _some_count(self) -> KeepLast:
        split = self.succeeded is not None or self.failed is not None
        if self.total is not None and split:
            raise ValueError("set total, or succeeded and/or failed, not both")
        if self.total is None and not split:
            raise ValueError("set total, or succeeded and/or failed")
        return self

    @property
    def field_path(self) -> tuple[str, ...] | None:
        """The keys of the field that names the group (`field:<path>`), None for a label."""
        how, _, path = self.group_by.partition(":")
        return parse_field_path(path) if how == "field" else None

    def group_label(self, labels: Mapping[str, str]) -> tuple[str, str] | None:
        """(key, value) of the label that names the run's group, or None (not grouped, or
        grouped by a field: see `field_path`)."""
        if self.group_by.startswith("field:"):
            return None
        keys = WELL_KNOWN_GROUP_LABELS if self.group_by == AUTO else (self.group_by[6:],)
        for key in keys:
            value = labels.get(key)
            if value:
                return key, value
        return None

    def buckets(self) -> Iterable[tuple[Bucket, int]]:
        """The buckets counted and how many of each stay."""
        if self.total is not None:
            yield "total", self.total
            return
        if self.succeeded is not None:
            yield "succeeded", self.succeeded
        if self.failed is not None:
            yield "failed", self.failed


Bucket = Literal["total", "succeeded", "failed"]


def bucket_of(phase: str, bucket: Bucket) -> bool:
    """Whether a finished run in `phase` is counted in `bucket` (every phase but
    Succeeded is a failure: Argo's Failed and Error, Tekton's and Jobs' Failed)."""
    if bucket == "total":
        return True
    return (phase == SUCCEEDED) == (bucket == "succeeded")


@dataclass(frozen=True, slots=True)
class CountedOut:
    """A run with at least N newer runs of its bucket: due `at` (when the run that pushed it
    out finished)."""

    uid: str
    at: datetime
    bucket: Bucket
    limit: int
    pushed_out_by: str  # the name of that run
    finished: datetime | None = None  # its own finish as listed (a floor counts from it)


def _newest_first(run: RunRef) -> tuple[datetime, str, str]:
    # A run without a finish time counts as the newest: it is never the one counted out.
    return (run.finished_at or _NEWEST, run.name, run.uid)


def count_out(members: Sequence[RunRef], rule: KeepLast, now: datetime) -> list[CountedOut]:
    """The members of one group counted out by `rule`, oldest last. `members` are the
    group's unpinned finished runs as listed; `now` stands in for a missing finish time."""
    out: list[CountedOut] = []
    for bucket, limit in rule.buckets():
        ranked = sorted(
            (run for run in members if bucket_of(run.phase, bucket)),
            key=_newest_first,
            reverse=True,
        )
        for index in range(limit, len(ranked)):
            pusher, run = ranked[index - limit], ranked[index]
            at = pusher.finished_at or now
            out.append(CountedOut(run.uid, at, bucket, limit, pusher.name, run.finished_at))
    return out


class ListedRun(RunRef):
    """A run as listed from the API server, with the object it was read from: what a
    `field:` group is read from (a run event carries labels, not the object's fields).
    Serialized (in an event) it is a RunRef: the object is not a field of it."""

    _object: Mapping[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def listed_object(self) -> Mapping[str, Any]:
        return self._object


def listed_object(run: RunRef) -> Mapping[str, Any] | None:
    """The object `run` was listed as, None when it was not listed (a run event's)."""
    return run.listed_object if isinstance(run, ListedRun) else None


def listed_runs(objects: Sequence[Mapping[str, Any]], kind: KindSpec) -> list[RunRef]:
    """The finished runs among objects listed from the API server: not being deleted, not
    running again, and readable (an unreadable object is left out, never counted out).
    Each is a `ListedRun`: its `field:` groups are read from the object listed."""
    runs: list[RunRef] = []
    for obj in objects:
        metadata = obj.get("metadata")
        if not isinstance(metadata, Mapping) or metadata.get("deletionTimestamp"):
            continue
        try:
            adapted = adapt(dict(obj), kind)
        except InvalidEvent:
            continue
        if isinstance(adapted, Ignored):
            continue
        assert isinstance(adapted, RunFinished)
        listed = ListedRun.model_construct(adapted.run.model_fields_set, **dict(adapted.run))
        listed._object = obj
        runs.append(listed)
    return runs
