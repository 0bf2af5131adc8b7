"""The policy engine: durations, Argo's ttlStrategy rule, precedence, matching, properties."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lapse.events.run import ArgoTTLStrategy, Engine, RunRef, Target
from lapse.functions.durations import (
    NEVER,
    DurationError,
    format_duration,
    parse_duration,
    parse_ttl,
)
from lapse.functions.policy import (
    EXPIRES_ANNOTATION,
    KEEP_ANNOTATION,
    TTL_ANNOTATION,
    Action,
    Decision,
    Match,
    Policy,
    check_policies,
    decide,
    parse_rfc3339,
    plan,
)

FINISHED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
NOW = datetime(2026, 1, 3, 0, 0, tzinfo=UTC)
K8S, DB = Target.KUBERNETES, Target.DATABASE


def make_run(**fields: Any) -> RunRef:
    base: dict[str, Any] = {
        "engine": Engine.ARGO,
        "api_version": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "namespace": "team-a",
        "name": "wf",
        "uid": "0b6c6b2e-0000-4000-8000-000000000001",
        "phase": "Succeeded",
        "finished_at": FINISHED,
    }
    return RunRef(**(base | fields))


def make_policy(name: str, **fields: Any) -> Policy:
    return Policy.model_validate({"name": name} | fields)


def strategy(
    completion: int | None = None, success: int | None = None, failure: int | None = None
) -> ArgoTTLStrategy:
    return ArgoTTLStrategy(
        seconds_after_completion=completion,
        seconds_after_success=success,
        seconds_after_failure=failure,
    )


# --- durations --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("30m", timedelta(minutes=30)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("2w", timedelta(weeks=2)),
        ("0s", timedelta(0)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("1w2d3h4m5s", timedelta(weeks=1, days=2, hours=3, minutes=4, seconds=5)),
        (" 12h ", timedelta(hours=12)),  # YAML block scalars can leave edge whitespace
    ],
)
def test_parse_duration_accepts(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected
    assert parse_ttl(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("3x", "unknown unit 'x'; use s, m, h, d or w"),
        ("12H", "unknown unit 'H'"),
        ("1y", "unknown unit 'y'"),
        ("30", "missing unit"),  # seconds? minutes? a bare number is a guess
        ("1.5h", "whole numbers only"),
        ("-5m", "no sign allowed"),
        ("+5m", "no sign allowed"),
        ("", "empty"),
        ("h", "expected a number and a unit"),
        ("3 h", "unknown unit ' h'"),
        ("30m1h", "units go largest first"),
        ("1h1h", "units go largest first"),
        ("9" * 20 + "d", "too large"),
        ("99999999999d", "too large"),
        ("never", "'never' is not allowed here"),
    ],
)
def test_parse_duration_rejects_with_a_clear_message(text: str, problem: str) -> None:
    with pytest.raises(DurationError) as caught:
        parse_duration(text, what="ttl")
    assert str(caught.value).startswith(f"ttl {text!r}: ")
    assert problem in str(caught.value)


def test_parse_duration_message_reads_as_documented() -> None:
    with pytest.raises(ValueError, match=r"^ttl '3x': unknown unit 'x'; use s, m, h, d or w$"):
        parse_duration("3x", what="ttl")


def test_never_is_a_ttl_but_not_a_duration() -> None:
    assert parse_ttl("never") is NEVER
    assert format_duration(NEVER) == "never"
    with pytest.raises(DurationError):
        parse_duration("never")


@given(st.integers(min_value=0, max_value=10**10))
def test_format_duration_round_trips(seconds: int) -> None:
    value = timedelta(seconds=seconds)
    assert parse_duration(format_duration(value)) == value


@pytest.mark.parametrize(
    ("value", "text"),
    [(timedelta(days=30), "30d"), (timedelta(days=14), "2w"), (timedelta(seconds=90), "1m30s")],
)
def test_format_duration_is_readable(value: timedelta, text: str) -> None:
    assert format_duration(value) == text


# --- Argo's ttlStrategy rule ------------------------------------------------------------

# (phase, ttlStrategy, expected field or None for "Argo says nothing", expected seconds)
ARGO_CASES = [
    ("Succeeded", strategy(success=10, completion=100), "secondsAfterSuccess", 10),
    ("Succeeded", strategy(failure=20, completion=100), "secondsAfterCompletion", 100),
    ("Succeeded", strategy(failure=20), None, None),
    ("Succeeded", strategy(10, 20, 30), "secondsAfterSuccess", 20),
    ("Succeeded", strategy(success=0, completion=100), "secondsAfterSuccess", 0),  # 0 is set
    ("Failed", strategy(failure=20, completion=100), "secondsAfterFailure", 20),
    ("Failed", strategy(success=10, completion=100), "secondsAfterCompletion", 100),
    ("Failed", strategy(success=10), None, None),
    ("Failed", strategy(10, 20, 30), "secondsAfterFailure", 30),
    ("Failed", strategy(failure=0, completion=100), "secondsAfterFailure", 0),
    # Error is neither Failed nor Succeeded: only secondsAfterCompletion ever applies.
    ("Error", strategy(success=10, failure=20, completion=100), "secondsAfterCompletion", 100),
    ("Error", strategy(success=10, failure=20), None, None),
    ("Error", strategy(completion=0), "secondsAfterCompletion", 0),
    ("Succeeded", strategy(), None, None),
]


@pytest.mark.parametrize(("phase", "ttl_strategy", "field", "seconds"), ARGO_CASES)
def test_argo_ttl_strategy_follows_argos_rule(
    phase: str, ttl_strategy: ArgoTTLStrategy, field: str | None, seconds: int | None
) -> None:
    decision = decide(make_run(phase=phase, ttl_strategy=ttl_strategy), K8S, [], NOW)
    if field is None:
        assert decision.policy == "default"
        assert decision.deadline == FINISHED + timedelta(hours=24)
    else:
        assert seconds is not None
        assert decision.policy == f"argo:ttlStrategy.{field}"
        assert decision.action is Action.SCHEDULE
        assert decision.deadline == FINISHED + timedelta(seconds=seconds)


def test_argo_ttl_strategy_beats_policies_but_not_lapse_ttl() -> None:
    policies = [make_policy("all", kubernetes={"ttl": "5m"})]
    run = make_run(ttl_strategy=strategy(completion=3600))
    assert decide(run, K8S, policies, NOW).policy == "argo:ttlStrategy.secondsAfterCompletion"
    annotated = make_run(ttl_strategy=strategy(completion=3600), annotations={TTL_ANNOTATION: "2h"})
    assert decide(annotated, K8S, policies, NOW).deadline == FINISHED + timedelta(hours=2)


# --- precedence -------------------------------------------------------------------------

ALL_SOURCES = {
    KEEP_ANNOTATION: "true",
    EXPIRES_ANNOTATION: "2026-06-01T00:00:00Z",
    TTL_ANNOTATION: "3h",
}
POLICIES = [make_policy("team", match={"namespaces": ["team-*"]}, kubernetes={"ttl": "1h"})]


@pytest.mark.parametrize(
    ("drop", "use_argo", "use_policy", "source", "deadline"),
    [
        ((), True, True, "annotation:lapse.dev/keep", None),
        (
            (KEEP_ANNOTATION,),
            True,
            True,
            "annotation:lapse.dev/expires",
            datetime(2026, 6, 1, tzinfo=UTC),
        ),
        (
            (KEEP_ANNOTATION, EXPIRES_ANNOTATION),
            True,
            True,
            "annotation:lapse.dev/ttl",
            FINISHED + timedelta(hours=3),
        ),
        (
            (KEEP_ANNOTATION, EXPIRES_ANNOTATION, TTL_ANNOTATION),
            True,
            True,
            "argo:ttlStrategy.secondsAfterSuccess",
            FINISHED + timedelta(seconds=7),
        ),
        (
            (KEEP_ANNOTATION, EXPIRES_ANNOTATION, TTL_ANNOTATION),
            False,
            True,
            "policy:team",
            FINISHED + timedelta(hours=1),
        ),
        (
            (KEEP_ANNOTATION, EXPIRES_ANNOTATION, TTL_ANNOTATION),
            False,
            False,
            "default",
            FINISHED + timedelta(hours=24),
        ),
    ],
)
def test_kubernetes_precedence(
    drop: tuple[str, ...],
    use_argo: bool,
    use_policy: bool,
    source: str,
    deadline: datetime | None,
) -> None:
    annotations = {k: v for k, v in ALL_SOURCES.items() if k not in drop}
    run = make_run(annotations=annotations, ttl_strategy=strategy(success=7) if use_argo else None)
    decision = decide(run, K8S, POLICIES if use_policy else [], NOW)
    assert (decision.policy, decision.deadline) == (source, deadline)
    assert decision.action is (Action.CANCEL if deadline is None else Action.SCHEDULE)


def test_keep_false_is_the_same_as_no_keep() -> None:
    run = make_run(annotations={KEEP_ANNOTATION: "false", TTL_ANNOTATION: "3h"})
    assert decide(run, K8S, [], NOW).policy == "annotation:lapse.dev/ttl"


def test_ttl_annotation_never_cancels() -> None:
    decision = decide(make_run(annotations={TTL_ANNOTATION: "never"}), K8S, [], NOW)
    assert (decision.action, decision.policy) == (Action.CANCEL, "annotation:lapse.dev/ttl")


def test_expires_is_absolute_and_normalized_to_utc() -> None:
    run = make_run(annotations={EXPIRES_ANNOTATION: "2026-03-01T10:00:00.5+02:00"})
    decision = decide(run, K8S, [], NOW)
    assert decision.deadline == datetime(2026, 3, 1, 8, 0, 0, 500000, tzinfo=UTC)
    assert decision.deadline is not None and decision.deadline.utcoffset() == timedelta(0)


def test_expires_in_the_past_is_honoured_not_rejected() -> None:
    # The owner asked for it: the scheduler fires a past deadline at once.
    run = make_run(annotations={EXPIRES_ANNOTATION: "2020-01-01T00:00:00Z"})
    decision = decide(run, K8S, [], NOW)
    assert decision.action is Action.SCHEDULE
    assert decision.deadline == datetime(2020, 1, 1, tzinfo=UTC)


def test_missing_finished_at_counts_from_now() -> None:
    decision = decide(make_run(finished_at=None, annotations={TTL_ANNOTATION: "1h"}), K8S, [], NOW)
    assert decision.deadline == NOW + timedelta(hours=1)
    assert "no finishedAt" in decision.reason


def test_deadline_past_year_9999_means_never() -> None:
    run = make_run(annotations={TTL_ANNOTATION: "99999999d"})
    assert decide(run, K8S, [], NOW).action is Action.CANCEL
    argo = make_run(ttl_strategy=strategy(completion=10**17))
    assert decide(argo, K8S, [], NOW).action is Action.CANCEL


# --- malformed annotations never fall through -------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "source", "in_reason"),
    [
        ({KEEP_ANNOTATION: "yes"}, KEEP_ANNOTATION, "use 'true' or 'false'"),
        ({KEEP_ANNOTATION: "True"}, KEEP_ANNOTATION, "'True'"),
        ({KEEP_ANNOTATION: ""}, KEEP_ANNOTATION, "use 'true' or 'false'"),
        ({EXPIRES_ANNOTATION: "tomorrow"}, EXPIRES_ANNOTATION, "not an RFC 3339 timestamp"),
        ({EXPIRES_ANNOTATION: "2026-01-02"}, EXPIRES_ANNOTATION, "RFC 3339"),
        ({EXPIRES_ANNOTATION: "2026-01-02T03:04:05"}, EXPIRES_ANNOTATION, "with offset"),
        ({EXPIRES_ANNOTATION: "2026-02-30T00:00:00Z"}, EXPIRES_ANNOTATION, "day is out of range"),
        ({TTL_ANNOTATION: "3x"}, TTL_ANNOTATION, "lapse.dev/ttl '3x': unknown unit 'x'"),
        ({TTL_ANNOTATION: "1.5h"}, TTL_ANNOTATION, "whole numbers only"),
        ({TTL_ANNOTATION: "30"}, TTL_ANNOTATION, "missing unit"),
        # A valid lower-precedence source must not hide a malformed higher one...
        ({EXPIRES_ANNOTATION: "soon", TTL_ANNOTATION: "1h"}, EXPIRES_ANNOTATION, "'soon'"),
        # ...and a malformed TTL must not fall through to a shorter engine or default TTL.
        ({TTL_ANNOTATION: "7days"}, TTL_ANNOTATION, "unknown unit 'days'"),
    ],
)
def test_malformed_annotation_is_invalid(
    annotations: dict[str, str], source: str, in_reason: str
) -> None:
    run = make_run(annotations=annotations, ttl_strategy=strategy(completion=1))
    decision = decide(run, K8S, POLICIES, NOW)
    assert decision.action is Action.INVALID
    assert decision.deadline is None
    assert decision.policy == f"annotation:{source}"
    assert in_reason in decision.reason


def test_keep_true_outranks_a_malformed_annotation() -> None:
    run = make_run(annotations={KEEP_ANNOTATION: "true", TTL_ANNOTATION: "3x"})
    assert decide(run, K8S, [], NOW).action is Action.CANCEL


@pytest.mark.parametrize(
    "text", ["2026-01-02T03:04:05Z", "2026-01-02t03:04:05z", "2026-01-02T03:04:05.123456789Z"]
)
def test_parse_rfc3339_accepts(text: str) -> None:
    assert parse_rfc3339(text).replace(microsecond=0) == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


# --- the database target ----------------------------------------------------------------


def test_database_default_is_never_and_ignores_object_annotations() -> None:
    run = make_run(
        annotations={TTL_ANNOTATION: "1s", EXPIRES_ANNOTATION: "2020-01-01T00:00:00Z"},
        ttl_strategy=strategy(completion=1),
    )
    decision = decide(run, DB, [], NOW)
    assert (decision.action, decision.policy) == (Action.CANCEL, "default")


def test_database_keep_only_through_a_policy() -> None:
    policies = [
        make_policy(
            "kept", match={"annotations": {KEEP_ANNOTATION: "true"}}, database={"ttl": "never"}
        ),
        make_policy("rows", database={"ttl": "90d"}),
    ]
    kept = make_run(annotations={KEEP_ANNOTATION: "true"})
    assert decide(kept, DB, policies, NOW).policy == "policy:kept"
    assert decide(kept, DB, policies[1:], NOW).deadline == FINISHED + timedelta(days=90)


def test_invalid_annotation_does_not_affect_the_database() -> None:
    run = make_run(annotations={TTL_ANNOTATION: "3x"})
    result = plan(run, [make_policy("rows", database={"ttl": "30d"})], NOW)
    assert result[K8S].action is Action.INVALID
    assert result[DB].deadline == FINISHED + timedelta(days=30)


# --- policies: per-target first match, phase clocks, matching ---------------------------


def test_first_match_is_per_target() -> None:
    policies = [
        make_policy("short-objects", match={"namespaces": ["team-*"]}, kubernetes={"ttl": "1h"}),
        make_policy("long-rows", database={"ttl": "1w"}),
        make_policy("unused", kubernetes={"ttl": "5m"}, database={"ttl": "1d"}),
    ]
    result = plan(make_run(), policies, NOW)
    assert result[K8S].policy == "policy:short-objects"
    assert result[DB].policy == "policy:long-rows"
    assert result[DB].deadline == FINISHED + timedelta(weeks=1)


@pytest.mark.parametrize(
    ("phase", "source", "ttl"),
    [
        ("Succeeded", "policy:phased", timedelta(minutes=10)),
        ("Failed", "policy:phased", timedelta(days=3)),
        ("Error", "policy:phased", timedelta(hours=1)),  # Error: ttl, as in Argo
        ("", "policy:phased", timedelta(hours=1)),
    ],
)
def test_policy_phase_clocks(phase: str, source: str, ttl: timedelta) -> None:
    policies = [
        make_policy(
            "phased", kubernetes={"ttl": "1h", "after_success": "10m", "after_failure": "3d"}
        ),
    ]
    decision = decide(make_run(phase=phase), K8S, policies, NOW)
    assert (decision.policy, decision.deadline) == (source, FINISHED + ttl)


def test_policy_without_a_clock_for_the_phase_passes_to_the_next() -> None:
    policies = [
        make_policy("success-only", kubernetes={"after_success": "10m"}),
        make_policy("rest", kubernetes={"ttl": "2d"}),
    ]
    assert decide(make_run(phase="Succeeded"), K8S, policies, NOW).policy == "policy:success-only"
    assert decide(make_run(phase="Failed"), K8S, policies, NOW).policy == "policy:rest"
    assert decide(make_run(phase="Error"), K8S, policies, NOW).policy == "policy:rest"


def test_policy_never_cancels() -> None:
    decision = decide(make_run(), K8S, [make_policy("p", kubernetes={"ttl": "never"})], NOW)
    assert (decision.action, decision.policy, decision.deadline) == (
        Action.CANCEL,
        "policy:p",
        None,
    )


@pytest.mark.parametrize(
    ("match", "matches"),
    [
        ({}, True),
        ({"engines": ["argo"]}, True),
        ({"engines": ["tekton", "job"]}, False),
        ({"namespaces": ["team-*"]}, True),
        ({"namespaces": ["team-?"]}, True),
        ({"namespaces": ["team"]}, False),
        ({"namespaces": ["*-a", "nope"]}, True),
        ({"namespaces": ["Team-*"]}, False),  # case-sensitive, like Kubernetes names
        ({"namespaces": ["eam-*"]}, False),  # globs anchor at both ends
        ({"labels": {"team": "ml"}}, True),
        ({"labels": {"team": "ML"}}, False),
        ({"labels": {"team": "ml", "tier": "gold"}}, False),  # every pair must hold
        ({"labels": {"pipeline/runid": "r-1"}}, True),
        ({"has_labels": ["pipeline/runid"]}, True),
        ({"has_labels": ["missing"]}, False),
        ({"annotations": {"owner": "ana"}}, True),
        ({"annotations": {"team": "ml"}}, False),  # labels and annotations are separate
        ({"has_annotations": ["owner"]}, True),
        ({"has_annotations": ["team"]}, False),
        ({"engines": ["argo"], "namespaces": ["team-*"], "labels": {"team": "ml"}}, True),
        ({"engines": ["argo"], "namespaces": ["other"], "labels": {"team": "ml"}}, False),
    ],
)
def test_match(match: dict[str, Any], matches: bool) -> None:
    run = make_run(labels={"team": "ml", "pipeline/runid": "r-1"}, annotations={"owner": "ana"})
    assert Match.model_validate(match).matches(run) is matches


# --- policy validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"name": "empty"}, "sets none of kubernetes, database, artifacts and keep_last"),
        ({"name": "k", "kubernetes": {}}, "set at least one of ttl, after_success"),
        ({"name": "bad name", "database": {"ttl": "1d"}}, "is not a policy name"),
        ({"name": "x", "database": {"ttl": "3x"}}, "'3x' is not a duration (unknown unit 'x'"),
        ({"name": "x", "database": {"ttl": 30}}, "'30' is not a duration (missing unit"),
        ({"name": "x", "database": {"after_failure": "1d"}}, "Extra inputs"),
        ({"name": "x", "match": {"engines": ["argo-wf"]}, "database": {"ttl": "1d"}}, "argo"),
        ({"name": "x", "match": {"namespaces": [""]}, "database": {"ttl": "1d"}}, "empty"),
    ],
)
def test_policy_validation(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Policy.model_validate(fields)
    assert problem in str(caught.value)


def test_check_policies_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match=r"'a' is used twice \(index 0 and 1\)"):
        check_policies(
            (make_policy("a", database={"ttl": "1d"}), make_policy("a", kubernetes={"ttl": "1d"}))
        )


def test_check_policies_rejects_what_a_match_all_policy_hides() -> None:
    default = make_policy("default", kubernetes={"ttl": "1d"})
    hidden = make_policy("ci", match={"namespaces": ["ci-*"]}, kubernetes={"ttl": "1h"})
    with pytest.raises(ValueError, match=r"'ci' \(index 1\) never sets the kubernetes TTL"):
        check_policies((default, hidden))
    # The database section of a later policy is still reachable, and so is a kubernetes
    # section after a match-all policy whose clock does not cover every phase.
    rows = make_policy("rows", database={"ttl": "1d"})
    partial = make_policy("partial", kubernetes={"after_success": "1m"})
    assert check_policies((default, rows)) == (default, rows)
    assert check_policies((partial, hidden)) == (partial, hidden)


def test_decision_requires_a_deadline_exactly_when_scheduling() -> None:
    with pytest.raises(ValueError, match="deadline"):
        Decision(K8S, Action.SCHEDULE, None, "default", "x")
    with pytest.raises(ValueError, match="deadline"):
        Decision(K8S, Action.CANCEL, NOW, "default", "x")


def test_now_must_be_aware() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        decide(make_run(), K8S, [], datetime(2026, 1, 1))


# --- properties -------------------------------------------------------------------------

LAPSE_KEYS = [KEEP_ANNOTATION, EXPIRES_ANNOTATION, TTL_ANNOTATION]
NAMESPACES = ["team-a", "team-b", "ci-1", "prod"]
LABELS = ["ml", "x"]
annotation_values = st.one_of(
    st.sampled_from(["true", "false", "never", "1h", "0s", "3x", "", "2026-05-01T00:00:00Z"]),
    st.text(max_size=12),
)
# Generation is cheap, but this suite shares machines with server builds: wall-clock health
# checks and deadlines would make it flaky without making it stricter.
PROPERTIES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ttl_texts = st.sampled_from(["0s", "1s", "90s", "30m", "12h", "7d", "2w", "never"])


@st.composite
def runs(draw: st.DrawFn) -> RunRef:
    annotations = draw(
        st.dictionaries(
            st.sampled_from([*LAPSE_KEYS, "owner", "note"]), annotation_values, max_size=4
        )
    )
    ttl = draw(
        st.none()
        | st.builds(
            strategy,
            st.none() | st.integers(0, 10**8),
            st.none() | st.integers(0, 10**8),
            st.none() | st.integers(0, 10**8),
        )
    )
    return make_run(
        engine=draw(st.sampled_from(list(Engine))),
        namespace=draw(st.sampled_from(NAMESPACES)),
        phase=draw(st.sampled_from(["Succeeded", "Failed", "Error", "", "Running"])),
        finished_at=draw(
            st.none()
            | st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC))
        ),
        labels=draw(st.dictionaries(st.sampled_from(["team", "tier"]), st.sampled_from(LABELS))),
        annotations=annotations,
        ttl_strategy=ttl,
    )


@st.composite
def policy_lists(draw: st.DrawFn) -> list[Policy]:
    policies = []
    for index in range(draw(st.integers(0, 4))):
        match: dict[str, Any] = {}
        if draw(st.booleans()):
            match["namespaces"] = draw(
                st.lists(st.sampled_from([*NAMESPACES, "team-*", "*"]), min_size=1, max_size=2)
            )
        if draw(st.booleans()):
            match["labels"] = {"team": draw(st.sampled_from(["ml", "x"]))}
        if draw(st.booleans()):
            match["annotations"] = {KEEP_ANNOTATION: "true"}
        sections: dict[str, Any] = {}
        if draw(st.booleans()):
            sections["kubernetes"] = {
                key: draw(ttl_texts)
                for key in draw(
                    st.sets(st.sampled_from(["ttl", "after_success", "after_failure"]), min_size=1)
                )
            }
        if draw(st.booleans()) or not sections:
            sections["database"] = {"ttl": draw(ttl_texts)}
        policies.append(make_policy(f"p{index}", match=match, **sections))
    return policies


@given(runs(), policy_lists(), st.sampled_from(list(Target)))
@PROPERTIES
def test_decide_never_raises_and_keeps_its_invariants(
    run: RunRef, policies: list[Policy], target: Target
) -> None:
    # Arbitrary annotation text comes from users: it must yield a decision, never a crash.
    decision = decide(run, target, policies, NOW)
    assert decision.target is target
    assert (decision.deadline is not None) == (decision.action is Action.SCHEDULE)
    if decision.deadline is not None:
        assert decision.deadline.utcoffset() == timedelta(0)


@given(runs(), policy_lists(), st.sampled_from(list(Target)))
@PROPERTIES
def test_ttl_based_deadline_is_never_before_the_run_finished(
    run: RunRef, policies: list[Policy], target: Target
) -> None:
    decision = decide(run, target, policies, NOW)
    if decision.action is Action.SCHEDULE and decision.policy != f"annotation:{EXPIRES_ANNOTATION}":
        assert decision.deadline is not None
        assert decision.deadline >= run.finished_or(NOW)


@given(runs(), policy_lists())
@PROPERTIES
def test_keep_always_wins_for_kubernetes(run: RunRef, policies: list[Policy]) -> None:
    kept = run.model_copy(update={"annotations": run.annotations | {KEEP_ANNOTATION: "true"}})
    decision = decide(kept, K8S, policies, NOW)
    assert (decision.action, decision.policy) == (Action.CANCEL, f"annotation:{KEEP_ANNOTATION}")


@given(runs(), policy_lists(), annotation_values, annotation_values)
@PROPERTIES
def test_database_ignores_ttl_and_expires_annotations(
    run: RunRef, policies: list[Policy], ttl: str, expires: str
) -> None:
    bare = {
        k: v for k, v in run.annotations.items() if k not in (TTL_ANNOTATION, EXPIRES_ANNOTATION)
    }
    changed = bare | {TTL_ANNOTATION: ttl, EXPIRES_ANNOTATION: expires}
    without = decide(run.model_copy(update={"annotations": bare}), DB, policies, NOW)
    with_them = decide(run.model_copy(update={"annotations": changed}), DB, policies, NOW)
    assert without == with_them


@given(
    st.lists(st.sampled_from(NAMESPACES), max_size=6),
    st.sampled_from(NAMESPACES),
    st.sampled_from(list(Target)),
)
@PROPERTIES
def test_first_matching_policy_wins(namespaces: list[str], namespace: str, target: Target) -> None:
    # Oracle independent of Match.matches: policy i matches exactly its literal namespace and
    # sets a TTL of i+1 hours, so the deadline tells which policy decided.
    policies = [
        make_policy(f"p{i}", match={"namespaces": [ns]}, **{target.value: {"ttl": f"{i + 1}h"}})
        for i, ns in enumerate(namespaces)
    ]
    decision = decide(make_run(namespace=namespace), target, policies, NOW)
    if namespace in namespaces:
        first = namespaces.index(namespace)
        assert decision.policy == f"policy:p{first}"
        assert decision.deadline == FINISHED + timedelta(hours=first + 1)
    else:
        assert decision.policy == "default"
