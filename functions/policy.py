"""When does a finished run expire? The pure policy engine (no I/O, no clock: `now` is given).

For each target the first source that has something to say decides.

Kubernetes object (`Target.KUBERNETES`):
  1. `lapse.dev/keep: "true"`   never delete; a pending schedule is cancelled.
  2. `lapse.dev/expires`        absolute RFC 3339 deadline.
  3. `lapse.dev/ttl`            duration after the run finished (or `never`).
  4. Argo `spec.ttlStrategy`    with Argo's own rule: phase `Failed` uses secondsAfterFailure
                                and `Succeeded` secondsAfterSuccess when set, every phase
                                otherwise secondsAfterCompletion (so `Error` only ever gets
                                secondsAfterCompletion).
  5. the first policy that matches the run and has a clock for its phase, in the order
     the caller gives: in lapse that is the LapsePolicy objects of the run's namespace,
     the ClusterLapsePolicy objects, then lapse.yaml's `policies` (functions/
     policy_objects.py builds the list; docs/policies.md).
  6. the built-in default: 24h after the run finished.

Artifacts in object storage (`Target.ARTIFACTS`): the first policy with an `artifacts`
clock, else the database clock (artifacts and rows are the run's record: by default they
go together).

Database rows (`Target.DATABASE`): only 5 and 6 (built-in default: never). The people who
run the database decide how long rows live, so annotations never set a database TTL and
`keep` does not apply by itself; a policy can still match on `lapse.dev/keep` through its
annotation selector.

A malformed `lapse.dev/*` annotation never falls through to a later source (that could
delete an object earlier than its owner asked): it yields an `invalid` decision, which the
caller dead-letters. Only `keep: "true"` outranks it, because keeping is always safe.

Policies are matched per target: a policy that configures only the Kubernetes clock says
nothing about the database, and the search for a database TTL continues with the next
policy. Likewise a Kubernetes section without a clock for the run's phase (e.g. only
`after_success` for a Failed run) passes to the next policy. Within a section the phase
rule is Argo's: `after_failure` for Failed, `after_success` for Succeeded, when set;
`ttl` otherwise.

Deadlines are `finishedAt + ttl` (`now + ttl` when the run has no finishedAt), in UTC.

Then the count (`keep_last`, functions/keep_last.py; docs/architecture.md, "Keep the last
N"): `with_count` makes a run counted out of its group due when the run that pushed it out
finished, if that comes before the deadline above; `keep` and an invalid annotation are
never overruled. A LapsePolicy's count holds the floor its ClusterLapsePolicies set
(`Floor`): a run it counts out is due no earlier than its own finish plus the Kubernetes
`minTTL` of its namespace, exactly as that policy's TTLs are clamped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Annotated, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from lapse.events.kinds import engine_ttl_field
from lapse.events.run import ArgoTTLStrategy, Engine, RunRef, Target
from lapse.events.timeutil import parse_rfc3339 as _parse_rfc3339
from lapse.functions.durations import (
    NEVER,
    DurationError,
    Ttl,
    TtlField,
    format_duration,
    parse_ttl,
)
from lapse.functions.keep_last import CountedOut, KeepLast, count_out, field_value, listed_object

KEEP_ANNOTATION: Final = "lapse.dev/keep"
EXPIRES_ANNOTATION: Final = "lapse.dev/expires"
TTL_ANNOTATION: Final = "lapse.dev/ttl"
KEEP_LAST_SOURCE: Final = "keep_last"

DEFAULT_KUBERNETES_TTL: Final[Ttl] = timedelta(hours=24)
DEFAULT_DATABASE_TTL: Final[Ttl] = NEVER


# --- policies ---------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _glob(pattern: str) -> str:
    if not pattern:
        raise ValueError("an empty pattern matches no namespace")
    return pattern


class Match(_Model):
    """Which runs a policy applies to. Every given condition must hold; an omitted or empty
    condition holds for every run, so an empty `match` matches everything.

    - `engines`: any of these engines.
    - `namespaces`: any of these shell globs (`team-*`, `ci-?`), case-sensitive.
    - `labels` / `annotations`: each key present with exactly this value.
    - `has_labels` / `has_annotations`: each key present, any value.
    """

    engines: tuple[Engine, ...] = ()
    namespaces: tuple[Annotated[str, AfterValidator(_glob)], ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    has_labels: tuple[str, ...] = ()
    has_annotations: tuple[str, ...] = ()

    @property
    def matches_everything(self) -> bool:
        return not (
            self.engines
            or self.namespaces
            or self.labels
            or self.annotations
            or self.has_labels
            or self.has_annotations
        )

    def matches(self, run: RunRef) -> bool:
        return (
            (not self.engines or run.engine in self.engines)
            and (not self.namespaces or any(fnmatchcase(run.namespace, p) for p in self.namespaces))
            and _selected(run.labels, self.labels, self.has_labels)
            and _selected(run.annotations, self.annotations, self.has_annotations)
        )


def _selected(values: Mapping[str, str], equal: Mapping[str, str], present: Sequence[str]) -> bool:
    return all(values.get(k) == v for k, v in equal.items()) and all(k in values for k in present)


class KubernetesClock(_Model):
    """The Kubernetes-object TTL of a policy, per phase like Argo's ttlStrategy: a Failed run
    uses `after_failure` and a Succeeded run `after_success` when set; every other case uses
    `ttl`. If the clock that applies is not set, the policy has no opinion for that run and
    the next matching policy is asked."""

    ttl: TtlField | None = None
    after_success: TtlField | None = None
    after_failure: TtlField | None = None

    @model_validator(mode="after")
    def _some_clock(self) -> KubernetesClock:
        if self.ttl is None and self.after_success is None and self.after_failure is None:
            raise ValueError("set at least one of ttl, after_success, after_failure")
        return self

    def for_phase(self, phase: str) -> tuple[str, Ttl] | None:
        """(key, ttl) that applies to a run in `phase`, or None."""
        if phase == "Failed" and self.after_failure is not None:
            return "after_failure", self.after_failure
        if phase == "Succeeded" and self.after_success is not None:
            return "after_success", self.after_success
        if self.ttl is not None:
            return "ttl", self.ttl
        return None


class DatabaseClock(_Model):
    """The database-rows TTL of a policy (one clock: rows have no phase-dependent life)."""

    ttl: TtlField


class ArtifactsClock(_Model):
    """The TTL of a run's artifacts and logs in object storage (one clock, like rows')."""

    ttl: TtlField


def _policy_name(name: str) -> str:
    # It ends up in `Decision.policy` ("policy:<name>") and the audit trail: keep it plain.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ValueError(f"{name!r} is not a policy name (letters, digits, '.', '-', '_')")
    return name


@dataclass(frozen=True, slots=True)
class Floor:
    """The least time a run counted out by a policy's `keep_last` stays after it finished:
    the Kubernetes `minTTL` the ClusterLapsePolicies covering a LapsePolicy's namespace set
    (`sources` names them). lapse.yaml's policies are the operator's own word: no floor."""

    minimum: timedelta
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"the minimum {format_duration(self.minimum)} ({', '.join(self.sources)})"


class Policy(_Model):
    """One entry of the ordered policy list. See the module docstring for how it is used."""

    name: Annotated[str, AfterValidator(_policy_name)]
    match: Match = Field(default_factory=Match)
    kubernetes: KubernetesClock | None = None
    database: DatabaseClock | None = None
    keep_last: KeepLast | None = None
    artifacts: ArtifactsClock | None = None

    @model_validator(mode="after")
    def _some_target(self) -> Policy:
        clocks = (self.kubernetes, self.database, self.artifacts, self.keep_last)
        if all(clock is None for clock in clocks):
            raise ValueError(
                f"policy {self.name!r} sets none of kubernetes, database, artifacts and keep_last"
            )
        return self

    @property
    def label(self) -> str:
        """How decisions name this policy (`Decision.policy`)."""
        return f"policy:{self.name}"

    @property
    def title(self) -> str:
        """How decision reasons name this policy."""
        return f"policy {self.name!r}"

    @property
    def keep_last_floor(self) -> Floor | None:
        """The floor of the runs this policy's `keep_last` counts out (a LapsePolicy's:
        functions/policy_objects.py); None: counted-out runs are due when pushed out."""
        return None

    def clock(self, target: Target, phase: str) -> tuple[str, Ttl] | None:
        """(key, ttl) this policy sets for `target` on a run in `phase`, or None."""
        if target is Target.KUBERNETES:
            return self.kubernetes.for_phase(phase) if self.kubernetes else None
        section = self.database if target is Target.DATABASE else self.artifacts
        return ("ttl", section.ttl) if section else None


def check_policies(policies: tuple[Policy, ...]) -> tuple[Policy, ...]:
    """Reject duplicate names and sections that can never apply (after a match-all policy
    whose clock covers every phase for that target): both are always configuration slips."""
    seen: dict[str, int] = {}
    covered: dict[Target, tuple[int, str]] = {}
    for index, policy in enumerate(policies):
        if policy.name in seen:
            raise ValueError(
                f"policy name {policy.name!r} is used twice (index {seen[policy.name]} and {index})"
            )
        seen[policy.name] = index
        for target, section in (
            (Target.KUBERNETES, policy.kubernetes),
            (Target.DATABASE, policy.database),
            (Target.ARTIFACTS, policy.artifacts),
        ):
            if section is None:
                continue
            if target in covered:
                first, name = covered[target]
                raise ValueError(
                    f"policy {policy.name!r} (index {index}) never sets the {target} TTL: "
                    f"{name!r} (index {first}) matches every run first"
                )
            if policy.match.matches_everything and section.ttl is not None:
                covered[target] = (index, policy.name)
    return policies


Policies = Annotated[tuple[Policy, ...], AfterValidator(check_policies)]
"""The ordered policy list as a pydantic field type (first match wins, per target)."""


# --- decisions --------------------------------------------------------------------------


class Action(StrEnum):
    SCHEDULE = "schedule"  # delete at `deadline`
    CANCEL = "cancel"  # never delete (keep, or a TTL of never): withdraw any schedule
    INVALID = "invalid"  # a malformed lapse.dev/* annotation: dead-letter, delete nothing


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do about one target of one run, and why.

    `policy` names what decided, as the events, the audit trail and `lapse plan` show it:
    `annotation:lapse.dev/keep|expires|ttl`, `argo:ttlStrategy.<field>`, `<kind>:<field>`
    (another engine's own TTL field: `job:spec.ttlSecondsAfterFinished`,
    `sparkapplication:spec.timeToLiveSeconds`), `policy:<name>`, a policy object
    (`lapsepolicy:<namespace>/<name>@<generation>`, `clusterlapsepolicy:<name>@<generation>`;
    functions/policy_objects.py), `default`, or `keep_last:<name>` (counted out of its
    group by that policy's `keep_last`; a policy object's name is its label).
    `deadline` is set (UTC) exactly when `action` is schedule.
    """

    target: Target
    action: Action
    deadline: datetime | None
    policy: str
    reason: str

    def __post_init__(self) -> None:
        if (self.action is Action.SCHEDULE) != (self.deadline is not None):
            raise ValueError("a deadline is given exactly when the action is schedule")


def decide(run: RunRef, target: Target, policies: Sequence[Policy], now: datetime) -> Decision:
    """The decision for one target; `now` stands in for a missing finishedAt."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    if target is Target.KUBERNETES:
        early = _from_annotations(run, now) or _from_argo(run, now)
        if early is not None:
            return early
    for policy in policies:
        clock = policy.clock(target, run.phase)
        if clock is not None and policy.match.matches(run):
            key, ttl = clock
            return _after(
                target,
                run,
                now,
                ttl,
                policy.label,
                f"{policy.title} {target}.{key}",
            )
    if target is Target.ARTIFACTS:
        return _on_database_clock(decide(run, Target.DATABASE, policies, now))
    default = DEFAULT_KUBERNETES_TTL if target is Target.KUBERNETES else DEFAULT_DATABASE_TTL
    return _after(target, run, now, default, "default", f"built-in default for {target}")


def _on_database_clock(database: Decision) -> Decision:
    """The artifacts' decision when no policy sets their clock: the rows' one."""
    return Decision(
        Target.ARTIFACTS,
        database.action,
        database.deadline,
        database.policy,
        f"the database clock: {database.reason}",
    )


def plan(
    run: RunRef,
    policies: Sequence[Policy],
    now: datetime,
    targets: Sequence[Target] = tuple(Target),
) -> dict[Target, Decision]:
    """The decision for every target (of `targets`)."""
    return {target: decide(run, target, policies, now) for target in targets}


# --- keep the last N (functions/keep_last.py counts) -------------------------------------


@dataclass(frozen=True, slots=True)
class Group:
    """Runs counted together: one policy's `keep_last`, in one namespace, of one kind, with
    one value of the group's label (or field, when `field`). `selector` lists them from
    the API server.

    A field is not selectable server-side (custom resources offer only metadata.name and
    metadata.namespace, and the `selectableFields` of a CRD that declares them: none of
    the engines' does), so a field group is listed as its whole namespace's objects of
    the kind, paged, and counted client-side: `selector` is empty. Its `value` is None
    when the run was not listed (a run event carries labels, not fields): the listing
    tells which group the run is in, and the count of a listing is right for every group
    it holds whole."""

    policy: str
    namespace: str
    api_group: str
    kind: str
    label: str  # the label key, or the field path (`field`)
    value: str | None
    field: bool = False
    # The least time a counted-out run stays after its finish (the policy's; None: none).
    floor: Floor | None = None

    @property
    def selector(self) -> str:
        """The label selector that lists the group (a field group: all, "")."""
        return "" if self.field else f"{self.label}={self.value}"

    def describe(self) -> str:
        if not self.field:
            return self.selector
        value = "(read from the listing)" if self.value is None else repr(self.value)
        return f"field {self.label}={value}"


def keep_last_group(run: RunRef, policies: Sequence[Policy]) -> tuple[Group, KeepLast] | None:
    """The group `run` is counted in, with its rule: the first matching policy that has a
    `keep_last` whose group label (or field) the run carries (else the next one is asked,
    like a clock); None when no policy counts it. Of a run not listed (no object to read
    a field from), a field group is the first matching policy's, with `value` None: the
    caller lists the namespace, whose count settles the run's group."""
    for policy in policies:
        rule = policy.keep_last
        if rule is None or not policy.match.matches(run):
            continue
        api_group = run.api_version.rpartition("/")[0]
        path = rule.field_path
        if path is not None:
            listed = listed_object(run)
            value = None if listed is None else field_value(listed, path)
            if listed is not None and value is None:
                continue
            field = rule.group_by[len("field:") :]
            group = Group(
                policy.name, run.namespace, api_group, run.kind, field, value, True,
                policy.keep_last_floor,
            )  # fmt: skip
            return group, rule
        found = rule.group_label(run.labels)
        if found is None:
            continue
        label, label_value = found
        group = Group(
            policy.name, run.namespace, api_group, run.kind, label, label_value,
            floor=policy.keep_last_floor,
        )  # fmt: skip
        return group, rule
    return None


def pinned(run: RunRef, policies: Sequence[Policy], now: datetime) -> bool:
    """Never counted out, and not counted: `lapse.dev/keep: "true"`, or a malformed
    `lapse.dev/*` annotation (which never deletes)."""
    if run.annotations.get(KEEP_ANNOTATION) == "true":
        return True
    return decide(run, Target.KUBERNETES, policies, now).action is Action.INVALID


Counted = tuple[Group, CountedOut]


def counted_out(
    runs: Sequence[RunRef], policies: Sequence[Policy], now: datetime
) -> dict[str, Counted]:
    """Every run counted out of its group, by uid, among `runs`: finished runs as listed
    from the API server a moment ago (functions/keep_last.py: `listed_runs`). Runs of
    other groups in `runs` are counted in their own group. A run of a `field:` group that
    was not listed (a plain RunRef: its field is unknown) is not counted."""
    groups: dict[Group, tuple[KeepLast, list[RunRef]]] = {}
    for run in runs:
        found = keep_last_group(run, policies)
        if found is None or pinned(run, policies, now):
            continue
        group, rule = found
        if group.field and group.value is None:
            continue  # not listed: which field group it is in is unknown, so never counted
        groups.setdefault(group, (rule, []))[1].append(run)
    return {
        out.uid: (group, out)
        for group, (rule, members) in groups.items()
        for out in count_out(members, rule, now)
    }


def count_deadline(counted: Counted, finished: datetime | None = None) -> datetime:
    """When a run counted out is due: when the run that pushed it out finished, and never
    before its own finish plus its group's floor. `finished`: the run's finish as the
    caller knows it (the reaper's is the planner's reference time when the object has
    none), else as listed; a run with neither is floored from when its pusher finished,
    or now (`out.at`): never earlier than its true finish plus the floor."""
    group, out = counted
    if group.floor is None:
        return out.at
    start = finished or out.finished or out.at
    try:
        return max(out.at, (start + group.floor.minimum).astimezone(UTC))
    except OverflowError:
        return datetime.max.replace(tzinfo=UTC)


def with_count(
    decision: Decision, counted: Counted | None, finished: datetime | None = None
) -> Decision:
    """The Kubernetes decision once the count is heard too: whichever comes first, the
    TTL or the count (`count_deadline`: never before its group's floor), deletes. `keep`
    and a malformed annotation still delete nothing."""
    if counted is None or decision.action is Action.INVALID:
        return decision
    if decision.action is Action.CANCEL and decision.policy == f"annotation:{KEEP_ANNOTATION}":
        return decision
    group, out = counted
    due = count_deadline(counted, finished)
    if decision.deadline is not None and decision.deadline <= due:
        return decision
    floored = (
        f"; kept at least {group.floor.describe()} after it finished"
        if group.floor is not None and due > out.at
        else ""
    )
    return Decision(
        Target.KUBERNETES,
        Action.SCHEDULE,
        due,
        f"{KEEP_LAST_SOURCE}:{group.policy}",
        f"policy {group.policy!r} keep_last.{out.bucket}={out.limit} for {group.describe()}: "
        f"not among the {out.limit} newest since {out.pushed_out_by} finished{floored}",
    )


def _from_annotations(run: RunRef, now: datetime) -> Decision | None:
    k8s = Target.KUBERNETES
    annotations = run.annotations
    keep = annotations.get(KEEP_ANNOTATION)
    if keep == "true":
        return Decision(
            k8s,
            Action.CANCEL,
            None,
            f"annotation:{KEEP_ANNOTATION}",
            f"{KEEP_ANNOTATION} is 'true': the object is kept",
        )
    if keep is not None and keep != "false":
        # Strict on purpose: a policy selector compares the exact string, so accepting
        # "True" here would keep the object while a keep-matching policy does not match.
        return _invalid(KEEP_ANNOTATION, f"{KEEP_ANNOTATION} {keep!r}: use 'true' or 'false'")

    expires = annotations.get(EXPIRES_ANNOTATION)
    if expires is not None:
        try:
            deadline = parse_rfc3339(expires)
        except ValueError as exc:
            return _invalid(EXPIRES_ANNOTATION, f"{EXPIRES_ANNOTATION} {expires!r}: {exc}")
        return Decision(
            k8s,
            Action.SCHEDULE,
            deadline,
            f"annotation:{EXPIRES_ANNOTATION}",
            f"{EXPIRES_ANNOTATION} is {expires}",
        )

    ttl_text = annotations.get(TTL_ANNOTATION)
    if ttl_text is not None:
        try:
            ttl = parse_ttl(ttl_text, what=TTL_ANNOTATION)
        except DurationError as exc:
            return _invalid(TTL_ANNOTATION, str(exc))
        return _after(k8s, run, now, ttl, f"annotation:{TTL_ANNOTATION}", TTL_ANNOTATION)
    return None


def argo_ttl(strategy: ArgoTTLStrategy, phase: str) -> tuple[str, int] | None:
    """Argo's own rule: (field, seconds) of the ttlStrategy field that applies, or None."""
    if phase == "Failed" and strategy.seconds_after_failure is not None:
        return "secondsAfterFailure", strategy.seconds_after_failure
    if phase == "Succeeded" and strategy.seconds_after_success is not None:
        return "secondsAfterSuccess", strategy.seconds_after_success
    if strategy.seconds_after_completion is not None:
        return "secondsAfterCompletion", strategy.seconds_after_completion
    return None


def _from_argo(run: RunRef, now: datetime) -> Decision | None:
    found = argo_ttl(run.ttl_strategy, run.phase) if run.ttl_strategy else None
    if found is None:
        return None
    field, seconds = found
    try:
        ttl = timedelta(seconds=seconds)
    except OverflowError:
        ttl = timedelta.max
    if run.engine is not Engine.ARGO:
        # Only Argo has a ttlStrategy; any other kind's engine TTL is one field of its own
        # (the adapter carries it as secondsAfterCompletion), so the label names that field.
        own = engine_ttl_field(run.api_version, run.kind)
        source = f"{run.kind.lower()}:{own}"
        return _after(Target.KUBERNETES, run, now, ttl, source, f"{own}={seconds}")
    return _after(
        Target.KUBERNETES,
        run,
        now,
        ttl,
        f"argo:ttlStrategy.{field}",
        f"ttlStrategy.{field}={seconds} (phase {run.phase or 'unknown'})",
    )


def _after(
    target: Target, run: RunRef, now: datetime, ttl: Ttl, source: str, what: str
) -> Decision:
    if not isinstance(ttl, timedelta):
        return Decision(target, Action.CANCEL, None, source, f"{what} is never")
    start, clock = (
        (run.finished_at, "finishedAt") if run.finished_at else (now, "now (no finishedAt)")
    )
    try:
        deadline = (start + ttl).astimezone(UTC)
    except OverflowError:
        # Past year 9999: the owner meant "practically never"; keeping is the safe reading.
        return Decision(
            target,
            Action.CANCEL,
            None,
            source,
            f"{what} {format_duration(ttl)} ends after year 9999: treated as never",
        )
    return Decision(
        target, Action.SCHEDULE, deadline, source, f"{what} {format_duration(ttl)} after {clock}"
    )


def _invalid(annotation: str, reason: str) -> Decision:
    return Decision(Target.KUBERNETES, Action.INVALID, None, f"annotation:{annotation}", reason)


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 timestamp with an explicit offset and a `T` (`2026-01-02T15:04:05Z`), in
    UTC: the shape Go's and kubectl's parsers accept, so an annotation means the same here."""
    try:
        return _parse_rfc3339(text, allow_space=False).astimezone(UTC)
    except OverflowError as exc:
        raise ValueError(f"not a valid RFC 3339 timestamp ({exc})") from None
    except ValueError as exc:
        if str(exc).startswith("not a valid"):
            raise  # the shape is right, the date is not: say which part
        raise ValueError(
            "not an RFC 3339 timestamp with offset, e.g. 2026-01-02T15:04:05Z"
        ) from None
