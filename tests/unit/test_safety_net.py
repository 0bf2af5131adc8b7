"""The safety net's pure parts: where a pass lists (safety.namespaces), how a pass counts
what the planner did (planned: no schedule stood; repaired: one moved or withdrawn), when
the next pass comes, its settings, and how `lapse status` shows it."""

from __future__ import annotations

import argparse
import io
import random
from datetime import UTC, datetime, timedelta

import pytest
from cloudevents.core.base import BaseCloudEvent

from lapse.cli.status import print_report
from lapse.config import ConfigError, load_config
from lapse.config.schema import ReconcileConfig
from lapse.events.builder import build_event
from lapse.events.models import CleanupCancelled, CleanupScheduled
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.functions.safety import NamespaceFilter
from lapse.operations.reconcile import RunCounts
from lapse.operations.reconcile.periodic import next_wait, pass_report
from lapse.operations.reconcile.scope import cleaned_namespaces, needs_namespace_list

RUN = RunRef(
    engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow", namespace="a",
    name="wf", uid="u1", phase="Succeeded", finished_at=datetime(2026, 1, 1, tzinfo=UTC),
)  # fmt: skip
NAMES = ["kube-system", "team-a", "team-b", "ci-1", "default"]


@pytest.mark.parametrize(
    ("include", "exclude", "scopes"),
    [
        # Names are listed one namespaced request each, sorted, once.
        (["team-b", "team-a", "team-a"], [], ("team-a", "team-b")),
        # A glob is matched against the Namespace list.
        (["team-*", "default"], [], ("default", "team-a", "team-b")),
        # Excluded ones are left out, by name or glob.
        (["team-*", "ci-*"], ["team-b"], ("ci-1", "team-a")),
        (["team-a"], ["team-*"], ()),
        # `*`: one cluster-wide list, filtered run by run.
        (["*"], ["kube-*"], (None,)),
        # A glob that matches nothing lists nothing.
        (["prod-*"], [], ()),
    ],
)
def test_a_pass_lists_each_namespace_safety_namespaces_admits(
    include: list[str], exclude: list[str], scopes: tuple[str | None, ...]
) -> None:
    within = NamespaceFilter(include=tuple(include), exclude=tuple(exclude))
    assert cleaned_namespaces(within, NAMES) == scopes


def test_the_namespace_list_is_read_only_for_a_glob() -> None:
    assert not needs_namespace_list(NamespaceFilter(include=("team-a", "team-b")))
    assert not needs_namespace_list(NamespaceFilter(include=("*",)))
    assert needs_namespace_list(NamespaceFilter(include=("team-a", "ci-*")))


def scheduled(target: Target, *, replaced: bool) -> BaseCloudEvent:
    data = CleanupScheduled(
        run=RUN, target=target, deadline=datetime.now(UTC), policy="p", replaced=replaced
    )
    return build_event(EventType.CLEANUP_SCHEDULED, source="/test", data=data)


def test_a_pass_counts_a_lost_run_as_planned_and_a_moved_deadline_as_repaired() -> None:
    counts = RunCounts()
    counts.listed = 5
    counts.record([scheduled(Target.KUBERNETES, replaced=False)])
    # A run with one deadline new and one moved: repaired (something stood and was wrong).
    counts.record(
        [scheduled(Target.KUBERNETES, replaced=True), scheduled(Target.DATABASE, replaced=False)]
    )
    cancelled = CleanupCancelled(run=RUN, target=Target.KUBERNETES, reason="keep")
    counts.record([build_event(EventType.CLEANUP_CANCELLED, source="/test", data=cancelled)])
    counts.record([])  # a deadline that stands: nothing emitted
    counts.record([])
    report = pass_report(100.0, 1.5, 2, counts, [])
    assert (report.listed, report.planned, report.repaired, report.unchanged) == (5, 1, 2, 2)
    assert report.ok
    assert report.as_json()["planned"] == 1
    failed = pass_report(100.0, 1.5, 2, counts, ["listing finished Workflows in b failed"])
    assert not failed.ok and failed.as_json()["problems"] == [
        "listing finished Workflows in b failed"
    ]


def test_passes_come_a_period_plus_up_to_the_jitter_apart_and_the_first_soon() -> None:
    settings = ReconcileConfig(period=timedelta(minutes=10), jitter=timedelta(minutes=1))
    rng = random.Random(7)
    firsts = [next_wait(settings, rng, first=True) for _ in range(200)]
    laters = [next_wait(settings, rng) for _ in range(200)]
    assert all(0 <= w <= 60 for w in firsts)
    assert all(600 <= w <= 660 for w in laters)
    assert len({round(w) for w in laters}) > 20  # spread, not one fixed instant


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"LAPSE_RECONCILE__PERIOD": "0s"}, "LAPSE_RECONCILE__PERIOD: must be longer than 0s"),
        ({"LAPSE_RECONCILE__PERIOD": "10"}, "LAPSE_RECONCILE__PERIOD: '10' is not a duration"),
        (
            {"LAPSE_RECONCILE__PERIOD": "1m", "LAPSE_RECONCILE__JITTER": "2m"},
            "reconcile: jitter is longer than period",
        ),
        ({"LAPSE_RECONCILE__PAGE_SIZE": "0"}, "LAPSE_RECONCILE__PAGE_SIZE"),
    ],
)
def test_a_bad_setting_is_a_config_error_naming_the_key(env: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, env=env)
    assert said in str(caught.value)


def test_the_defaults_are_ten_minutes_and_a_minute() -> None:
    settings = load_config(None, env={}).reconcile
    assert settings.enabled
    assert (settings.period, settings.jitter) == (timedelta(minutes=10), timedelta(minutes=1))


def test_lapse_status_shows_the_last_pass() -> None:
    report = {
        "nats": {"url": "nats://x", "from": "config"},
        "database": {"url": None, "from": None},
        "pending": {},
        "waiting": [],
        "tasks": [],
        "relisting": [],
        "safetyNet": [
            {
                "process": "pod-1",
                "lastPass": "2026-01-01T00:00:00Z",
                "secondsAgo": 42,
                "seconds": 0.5,
                "listed": 12,
                "planned": 1,
                "repaired": 2,
                "errors": 0,
                "problems": ["listing finished Workflows in b failed: HTTP 403: forbidden"],
                "ok": False,
            },
        ],
        "deadLetters": 0,
        "recent": [],
    }
    out = io.StringIO()
    print_report(report, argparse.Namespace(output="table", watch=False, no_headers=False), out)
    line = next(line for line in out.getvalue().splitlines() if line.startswith("safety net:"))
    assert "last pass 2026-01-01T00:00:00Z (42s ago" in line
    assert "12 finished runs seen, 1 planned, 2 repaired, 0 not planned" in line
    assert "HTTP 403: forbidden" in line
