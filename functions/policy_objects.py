"""Policies as Kubernetes objects: `LapsePolicy` (namespaced) and `ClusterLapsePolicy`
(cluster-scoped), group `lapse.dev`, version `v1alpha1` (docs/policies.md). Pure: objects
in (the dicts the API server returns), policies and verdicts out.

- A `ClusterLapsePolicy` is a policy for the runs it matches (its clocks are the defaults
  there) and, in `spec.namespacedPolicies`, the rule for the `LapsePolicy` objects of the
  namespaces its `match.namespaces` covers: whether they may exist at all, and the minimum
  and maximum TTL per target.
- A `LapsePolicy` applies to runs of its own namespace only: its `match` has no
  `namespaces`, and the policy built here is pinned to the namespace it lives in.
  It is honoured where a covering ClusterLapsePolicy allows namespaced policies and none
  forbids them. A TTL outside the bounds is clamped to the nearest bound, and its
  `keepLast` holds the Kubernetes minimum too (a run it counts out stays at least that long
  after its finish: `Floor`); a refusal or a clamp is said in the object's
  `status.conditions` (type `Accepted`), never silent.
  What the schema can say (duration syntax, the fixed 1m minimum, at least one clock), the
  API server refuses itself (infra/crds/).

The order (docs/architecture.md, "Deadlines"): after the annotations and the engine's own
TTL, the LapsePolicies of the run's namespace (by name), then the ClusterLapsePolicies (by
name), then lapse.yaml's `policies`, then the built-in default.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Any, Final, overload

from pydantic import ValidationError

from lapse.functions.durations import NEVER, DurationError, Ttl, format_duration, parse_ttl
from lapse.functions.policy import Floor, Policy

GROUP: Final = "lapse.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
LAPSE_POLICY: Final = "LapsePolicy"
CLUSTER_LAPSE_POLICY: Final = "ClusterLapsePolicy"
# The status condition lapse writes on every policy object.
ACCEPTED: Final = "Accepted"

# Targets with a clock, as the objects spell them, and each one's TTL keys.
_CLOCKS: Final = {
    "kubernetes": ("ttl", "afterSuccess", "afterFailure"),
    "database": ("ttl",),
    "artifacts": ("ttl",),
}
_SNAKE: Final = {
    "afterSuccess": "after_success",
    "afterFailure": "after_failure",
    "hasLabels": "has_labels",
    "hasAnnotations": "has_annotations",
    "keepLast": "keep_last",
    "groupBy": "group_by",
}


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """Which object a policy came from, as plan and history name it:
    `lapsepolicy:<namespace>/<name>@<generation>`, `clusterlapsepolicy:<name>@<generation>`."""

    kind: str
    namespace: str | None
    name: str
    generation: int

    @property
    def label(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind.lower()}:{where}@{self.generation}"[:253]

    @property
    def key(self) -> tuple[str, str | None, str]:
        return self.kind, self.namespace, self.name


def ref_of(obj: Mapping[str, Any]) -> ObjectRef:
    metadata = obj.get("metadata") or {}
    return ObjectRef(
        str(obj.get("kind", "")),
        metadata.get("namespace") or None,
        str(metadata.get("name", "")),
        int(metadata.get("generation") or 0),
    )


class ObjectPolicy(Policy):
    """A policy built from an object: its name is the object's label
    (`lapsepolicy:<namespace>/<name>@<generation>`), so every decision it makes names the
    object, keep_last's too (`keep_last:<label>`). `floor`: a LapsePolicy's, the Kubernetes
    minimum of its namespace, held by the runs its `keep_last` counts out."""

    name: str
    floor: Floor | None = None

    @property
    def keep_last_floor(self) -> Floor | None:
        return self.floor

    @property
    def label(self) -> str:
        return self.name

    @property
    def title(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Verdict:
    """What lapse made of one policy object: its `Accepted` condition."""

    ref: ObjectRef
    accepted: bool
    reason: str  # Accepted, Clamped, NotAllowed, ConflictingBounds, Invalid
    message: str
    policy: ObjectPolicy | None = None


@dataclass(frozen=True, slots=True)
class Bound:
    minimum: timedelta | None = None
    maximum: timedelta | None = None  # None: no maximum (never allowed)
    sources: tuple[str, ...] = ()  # the ClusterLapsePolicies that set it
    # Of those, the ones that set the minimum, and the maximum, that hold.
    minimum_by: tuple[str, ...] = ()
    maximum_by: tuple[str, ...] = ()

    def set_by(self, side: str) -> str:
        """Who set the `side` ("minimum" or "maximum") bound, as the status names them."""
        return ", ".join(self.minimum_by if side == "minimum" else self.maximum_by)


@dataclass(frozen=True, slots=True)
class ClusterRule:
    """What one ClusterLapsePolicy says about the LapsePolicies in its namespaces."""

    ref: ObjectRef
    namespaces: tuple[str, ...]  # globs; empty: every namespace
    allowed: bool | None  # None: says nothing (no namespacedPolicies)
    bounds: dict[str, tuple[timedelta | None, timedelta | None]]

    def covers(self, namespace: str) -> bool:
        return not self.namespaces or any(fnmatchcase(namespace, p) for p in self.namespaces)


class PolicyError(ValueError):
    """An object lapse cannot use (what the schema let through and lapse does not)."""


def _snake(section: Mapping[str, Any]) -> dict[str, Any]:
    """A section's own keys in the model's spelling (never the label keys inside it)."""
    return {_SNAKE.get(k, k): v for k, v in section.items()}


# keep_last and artifacts are modelled by their own work (functions/policy.py): an object
# carrying one is used once the model has it, and refused (with the reason) until then.
_OPTIONAL_FIELDS: Final = (("keepLast", "keep_last"), ("artifacts", "artifacts"))


def _policy(
    ref: ObjectRef, spec: Mapping[str, Any], namespace: str | None, floor: Floor | None = None
) -> ObjectPolicy:
    body: dict[str, Any] = {"name": ref.label, "floor": floor}
    match = _snake(dict(spec.get("match") or {}))
    if namespace is not None:
        # Whatever the object says, a namespaced policy reaches its own namespace only.
        match["namespaces"] = [namespace]
    body["match"] = match
    for key in ("kubernetes", "database"):
        if spec.get(key) is not None:
            body[key] = _snake(dict(spec[key]))
    for key, model_field in _OPTIONAL_FIELDS:
        if spec.get(key) is None:
            continue
        if model_field not in Policy.model_fields:
            raise PolicyError(f"spec.{key} is not supported by this lapse version")
        body[model_field] = _snake(dict(spec[key]))  # the keep_last / artifacts conversion
    try:
        return ObjectPolicy.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PolicyError(problems) from None


def _duration(text: Any, what: str) -> Ttl:
    try:
        return parse_ttl(str(text), what=what)
    except DurationError as exc:
        raise PolicyError(str(exc)) from None


def cluster_rule(obj: Mapping[str, Any]) -> ClusterRule:
    ref = ref_of(obj)
    spec = obj.get("spec") or {}
    rules = spec.get("namespacedPolicies")
    bounds: dict[str, tuple[timedelta | None, timedelta | None]] = {}
    if rules:
        for target in _CLOCKS:
            given = rules.get(target) or {}
            low = _duration(given["minTTL"], f"{target}.minTTL") if "minTTL" in given else None
            high = _duration(given["maxTTL"], f"{target}.maxTTL") if "maxTTL" in given else None
            bounds[target] = (
                low if isinstance(low, timedelta) else None,
                high if isinstance(high, timedelta) else None,
            )
    namespaces = tuple((spec.get("match") or {}).get("namespaces") or ())
    allowed = bool(rules["allowed"]) if rules else None
    return ClusterRule(ref, namespaces, allowed, bounds)


def cluster_policy(obj: Mapping[str, Any]) -> Verdict:
    """A ClusterLapsePolicy: its own policy (None when it only sets bounds)."""
    ref = ref_of(obj)
    spec = dict(obj.get("spec") or {})
    try:
        cluster_rule(obj)
        has_clock = any(spec.get(k) is not None for k in (*_CLOCKS, "keepLast"))
        policy = _policy(ref, spec, None) if has_clock else None
    except PolicyError as exc:
        return Verdict(ref, False, "Invalid", str(exc))
    return Verdict(ref, True, ACCEPTED, "in effect", policy)


def bounds_for(namespace: str, rules: Sequence[ClusterRule]) -> dict[str, Bound]:
    """The tightest bounds every covering ClusterLapsePolicy sets, per target."""
    out: dict[str, Bound] = {}
    for target in _CLOCKS:
        low: timedelta | None = None
        high: timedelta | None = None
        sources: list[str] = []
        for rule in rules:
            if not rule.covers(namespace) or target not in rule.bounds:
                continue
            rule_low, rule_high = rule.bounds[target]
            if rule_low is not None and (low is None or rule_low > low):
                low = rule_low
            if rule_high is not None and (high is None or rule_high < high):
                high = rule_high
            if rule_low is not None or rule_high is not None:
                sources.append(rule.ref.label)
        held = [r for r in rules if r.covers(namespace) and target in r.bounds]
        out[target] = Bound(
            low, high, tuple(sources),
            tuple(r.ref.label for r in held if low is not None and r.bounds[target][0] == low),
            tuple(r.ref.label for r in held if high is not None and r.bounds[target][1] == high),
        )  # fmt: skip
    return out


def _clamp(value: Ttl, bound: Bound) -> Ttl:
    if bound.maximum is not None and (value is NEVER or value > bound.maximum):
        return bound.maximum
    if bound.minimum is not None and value is not NEVER and value < bound.minimum:
        return bound.minimum
    return value


def _show(value: Ttl) -> str:
    return NEVER.value if value is NEVER else format_duration(value)


def _keep_last_floor(spec: Mapping[str, Any], bound: Bound) -> Floor | None:
    """The floor of a LapsePolicy's count: the Kubernetes minimum, which its TTLs are
    clamped to. Without it a count would make an older run due the moment a newer one
    finished, however short a time after its own finish: the minimum by another road."""
    if spec.get("keepLast") is None or bound.minimum is None:
        return None
    return Floor(bound.minimum, bound.minimum_by)


def namespaced_policy(obj: Mapping[str, Any], rules: Sequence[ClusterRule]) -> Verdict:
    """A LapsePolicy judged against the ClusterLapsePolicies: refused, or in effect (with
    every TTL outside the bounds clamped, and the condition saying which)."""
    ref = ref_of(obj)
    namespace = ref.namespace or ""
    covering = [rule for rule in rules if rule.covers(namespace) and rule.allowed is not None]
    forbidding = [rule.ref.label for rule in covering if rule.allowed is False]
    if forbidding:
        return Verdict(
            ref, False, "NotAllowed",
            f"{', '.join(forbidding)} does not allow LapsePolicies in namespace {namespace}",
        )  # fmt: skip
    if not covering:
        return Verdict(
            ref, False, "NotAllowed",
            f"no ClusterLapsePolicy allows LapsePolicies in namespace {namespace} "
            "(spec.namespacedPolicies.allowed: true)",
        )  # fmt: skip
    bounds = bounds_for(namespace, rules)
    for target, bound in bounds.items():
        if (
            bound.minimum is not None
            and bound.maximum is not None
            and bound.minimum > bound.maximum
        ):
            return Verdict(
                ref, False, "ConflictingBounds",
                f"{target}: the minimum {_show(bound.minimum)} is longer than the maximum "
                f"{_show(bound.maximum)} ({', '.join(bound.sources)})",
            )  # fmt: skip
    spec = copy.deepcopy(dict(obj.get("spec") or {}))
    notes: list[str] = []
    for target, keys in _CLOCKS.items():
        section = spec.get(target)
        if not isinstance(section, dict):
            continue
        for key in keys:
            if key not in section:
                continue
            try:
                value = _duration(section[key], f"{target}.{key}")
            except PolicyError as exc:
                return Verdict(ref, False, "Invalid", str(exc))
            clamped = _clamp(value, bounds[target])
            if clamped != value:
                side = "maximum" if clamped == bounds[target].maximum else "minimum"
                notes.append(
                    f"{target}.{key} {_show(value)} clamped to the {side} {_show(clamped)} "
                    f"({bounds[target].set_by(side)})"
                )
                section[key] = _show(clamped)
    floor = _keep_last_floor(spec, bounds["kubernetes"])
    if floor is not None:
        notes.append(
            f"keepLast: a run it counts out is kept at least the minimum "
            f"{_show(floor.minimum)} after it finished ({', '.join(floor.sources)})"
        )
    try:
        policy = _policy(ref, spec, namespace, floor)
    except PolicyError as exc:
        return Verdict(ref, False, "Invalid", str(exc))
    if notes:
        return Verdict(ref, True, "Clamped", "; ".join(notes), policy)
    return Verdict(ref, True, ACCEPTED, f"in effect for namespace {namespace}", policy)


@dataclass(frozen=True)
class Effective:
    """Every policy in the order `decide` asks them, and a verdict per object."""

    policies: tuple[Policy, ...]
    verdicts: tuple[Verdict, ...]


def effective(
    namespaced: Sequence[Mapping[str, Any]],
    clusters: Sequence[Mapping[str, Any]],
    configured: Sequence[Policy] = (),
) -> Effective:
    """The policy list lapse plans with, given every policy object and lapse.yaml's."""
    by_name = sorted(clusters, key=lambda o: str((o.get("metadata") or {}).get("name", "")))
    rules: list[ClusterRule] = []
    cluster_verdicts = []
    for obj in by_name:
        verdict = cluster_policy(obj)
        cluster_verdicts.append(verdict)
        if verdict.accepted:
            rules.append(cluster_rule(obj))
    ordered = sorted(namespaced, key=lambda o: (ref_of(o).namespace or "", ref_of(o).name))
    namespaced_verdicts = [namespaced_policy(obj, rules) for obj in ordered]
    policies: list[Policy] = [v.policy for v in namespaced_verdicts if v.policy is not None]
    policies += [v.policy for v in cluster_verdicts if v.policy is not None]
    policies += configured
    return Effective(tuple(policies), (*namespaced_verdicts, *cluster_verdicts))


@dataclass
class PolicyBook(Sequence[Policy]):
    """The policies in effect now, shared by the planner and the reaper of one process and
    replaced whole when a policy object changes (lapse/runtime/policy_watcher.py). Reads
    see one list or the next, never a mix: the replacement is one assignment."""

    configured: tuple[Policy, ...] = ()
    _current: tuple[Policy, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self._current = self.configured

    def replace(self, policies: tuple[Policy, ...]) -> None:
        self._current = policies

    def __iter__(self) -> Iterator[Policy]:
        return iter(self._current)

    def __len__(self) -> int:
        return len(self._current)

    @overload
    def __getitem__(self, index: int) -> Policy: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Policy]: ...

    def __getitem__(self, index: int | slice) -> Policy | Sequence[Policy]:
        return self._current[index]
