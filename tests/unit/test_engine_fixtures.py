"""What the engines teach (issue 39): objects a real engine's controller wrote, recorded from
the test cluster (tests/fixtures/engines/, by tests/cluster/test_engines_on_cluster.py),
fed to lapse's pure decisions; and the hand-written objects of lapse's other tests and of
`lapse demo` held to the same shape, so that they cannot drift from what the engine writes.
docs/engines.md's compatibility table is checked against the recordings here too."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from lapse.events.adapters.objects import adapt
from lapse.events.adapters.result import Ignored
from lapse.events.kinds import JOB
from lapse.events.models import RunFinished
from lapse.events.run import Target
from lapse.functions.policy import Action, plan
from tests.e2e.test_forged_inputs import job_body
from tests.integration.test_kinds import job as integration_job
from tests.unit.test_events_adapters import JOB as ADAPTER_JOB

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests/fixtures/engines"
ENGINES_DOC = REPO / "docs/engines.md"
RECORDED_JOBS = sorted(FIXTURES.glob("kubernetes-*-jobs.json"))
NOW = datetime(2030, 1, 1, tzinfo=UTC)  # long after every recording


def recorded(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(path.read_text())
    return found


def condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in job["status"].get("conditions", []) if c["type"] == kind
    ]
    assert len(found) == 1, (kind, found)
    return found[0]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def deadline(job: dict[str, Any]) -> tuple[datetime | None, str]:
    result = adapt(job, JOB)
    assert isinstance(result, RunFinished), result
    decision = plan(result.run, (), NOW, (Target.KUBERNETES,))[Target.KUBERNETES]
    assert decision.action is Action.SCHEDULE, decision
    return decision.deadline, decision.policy


def test_jobs_were_recorded() -> None:
    assert RECORDED_JOBS, f"no recording under {FIXTURES}"
    for path in RECORDED_JOBS:
        assert set(recorded(path)["jobs"]) == {
            "succeeded", "failed", "engine-first", "lapse-first", "running"
        }, path  # fmt: skip


@pytest.mark.parametrize("path", RECORDED_JOBS, ids=lambda p: p.stem)
def test_a_real_succeeded_job_is_due_its_ttl_after_the_complete_condition(path: Path) -> None:
    job = recorded(path)["jobs"]["succeeded"]
    complete = at(condition(job, "Complete")["lastTransitionTime"])
    # The controller writes SuccessCriteriaMet first (pods may still terminate): not done.
    assert condition(job, "SuccessCriteriaMet")["status"] == "True"
    assert deadline(job) == (complete + timedelta(seconds=8), "annotation:lapse.dev/ttl")
    result = adapt(job, JOB)
    assert isinstance(result, RunFinished) and result.run.phase == "Succeeded"
    assert result.run.finished_at == complete
    assert result.run.uid == job["metadata"]["uid"]


@pytest.mark.parametrize("path", RECORDED_JOBS, ids=lambda p: p.stem)
def test_a_real_failed_job_has_no_completion_time_and_is_due_after_the_failed_condition(
    path: Path,
) -> None:
    job = recorded(path)["jobs"]["failed"]
    # The controller writes completionTime only on success: lapse must read the condition.
    assert "completionTime" not in job["status"], job["status"]
    assert condition(job, "FailureTarget")["reason"] == "BackoffLimitExceeded"
    failed = at(condition(job, "Failed")["lastTransitionTime"])
    result = adapt(job, JOB)
    assert isinstance(result, RunFinished) and result.run.phase == "Failed"
    assert deadline(job) == (failed + timedelta(seconds=8), "annotation:lapse.dev/ttl")


@pytest.mark.parametrize("path", RECORDED_JOBS, ids=lambda p: p.stem)
def test_a_real_jobs_own_ttl_gives_the_ttl_controllers_deadline(path: Path) -> None:
    jobs = recorded(path)["jobs"]
    engine_first = jobs["engine-first"]
    complete = at(condition(engine_first, "Complete")["lastTransitionTime"])
    # Under lapse.dev/ttl the annotation decides (the TTL controller came first on the
    # cluster); without it, the Job's own field, counted as the TTL controller counts.
    assert deadline(engine_first)[0] == complete + timedelta(seconds=12)
    bare = json.loads(json.dumps(engine_first))
    del bare["metadata"]["annotations"]["lapse.dev/ttl"]
    assert deadline(bare) == (complete + timedelta(seconds=2), "job:spec.ttlSecondsAfterFinished")
    lapse_first = jobs["lapse-first"]
    complete = at(condition(lapse_first, "Complete")["lastTransitionTime"])
    assert deadline(lapse_first) == (complete + timedelta(seconds=8), "annotation:lapse.dev/ttl")


@pytest.mark.parametrize("path", RECORDED_JOBS, ids=lambda p: p.stem)
def test_a_real_running_job_is_not_finished(path: Path) -> None:
    job = recorded(path)["jobs"]["running"]
    assert job["status"]["active"] == 1
    assert isinstance(adapt(job, JOB), Ignored)


def hand_written_jobs() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every finished Job lapse's tests write themselves: (metadata, status). (The demo's
    own copy is checked by tests/e2e/test_demo.py, which alone may import the demo.)"""
    body, status = integration_job("team-a", "report")
    found = {"tests/integration/test_kinds.job": (body["metadata"], status)}
    body, status = job_body("report", running=False)
    found["tests/e2e/test_forged_inputs.job_body"] = (body["metadata"], status)
    found["tests/unit/test_events_adapters.JOB"] = (ADAPTER_JOB["metadata"], ADAPTER_JOB["status"])
    return found


def check_job_shape(where: str, metadata: dict[str, Any], status: dict[str, Any]) -> None:
    """The conditions (types in order, their fields and reasons) and the status fields of
    a succeeded Job, as the real controller wrote them in every recording."""
    for path in RECORDED_JOBS:
        real = recorded(path)["jobs"]["succeeded"]
        real_conditions = real["status"]["conditions"]
        conditions = status["conditions"]
        assert [c["type"] for c in conditions] == [c["type"] for c in real_conditions], where
        for mine, theirs in zip(conditions, real_conditions, strict=True):
            assert sorted(mine) == sorted(theirs), (where, mine)
            assert (mine["reason"], mine["message"]) == (theirs["reason"], theirs["message"])
            assert mine["lastProbeTime"] == mine["lastTransitionTime"], (where, mine)
        assert sorted(status) == sorted(real["status"]), where
        assert status["completionTime"] == conditions[-1]["lastTransitionTime"], where
    # A Job made directly has no owner; one a CronJob made is controlled by it (and so left
    # to the CronJob by lapse), which a hand-written owner must say too.
    for owner in metadata.get("ownerReferences", []):
        assert owner.get("controller") is True, (where, owner)


@pytest.mark.parametrize("where", sorted(hand_written_jobs()))
def test_hand_written_jobs_are_shaped_as_the_controller_writes_them(where: str) -> None:
    metadata, status = hand_written_jobs()[where]
    check_job_shape(where, metadata, status)


def test_the_compatibility_table_lists_what_was_recorded() -> None:
    """docs/engines.md names each recorded engine version, and records each version it
    names (the table says what ran, not what is hoped)."""
    rows = re.findall(r"^\| Kubernetes Job controller \| (v[0-9.]+) \|", ENGINES_DOC.read_text(),
                      re.MULTILINE)  # fmt: skip
    versions = {recorded(p)["version"] for p in RECORDED_JOBS}
    assert sorted(rows) == sorted(versions)
    for path in RECORDED_JOBS:
        assert path.name == f"kubernetes-{recorded(path)['version']}-jobs.json"
