"""The Tekton Results gate (functions/object_reaper/gates.py): a PipelineRun or TaskRun is
not deleted before the Results watcher marked it `results.tekton.dev/stored: "true"`, the
annotation tektoncd/results' watcher writes once the run is done and its record upserted
(pkg/watcher/reconciler/dynamic, addStoredAnnotations). Annotations here are the ones that
watcher writes: `results.tekton.dev/result`, `results.tekton.dev/record`,
`results.tekton.dev/stored`."""

from __future__ import annotations

from typing import Any

import pytest

from lapse.events.kinds import TEKTON_PIPELINERUN, TEKTON_TASKRUN, Gate, KindSpec
from lapse.events.run import Engine, RunRef
from lapse.functions.object_reaper.gates import closed_gate
from lapse.functions.safety import SafetyConfig

RESULT = "results.tekton.dev/result"
RECORD = "results.tekton.dev/record"
STORED = "results.tekton.dev/stored"
UID = "pr-uid-1"


def watched(stored: str | None) -> dict[str, str]:
    """The annotations the watcher leaves after upserting a record (and, when done, the mark)."""
    marks = {RESULT: "team-a/results/r1", RECORD: "team-a/results/r1/records/r1"}
    if stored is not None:
        marks[STORED] = stored
    return marks


def run(kind: KindSpec, annotations: dict[str, str]) -> RunRef:
    return RunRef(
        engine=Engine.TEKTON,
        api_version="tekton.dev/v1",
        kind=kind.kind,
        namespace="team-a",
        name="build",
        uid=UID,
        phase="Succeeded",
        annotations=annotations,
    )


def taskrun(name: str, annotations: dict[str, str], owner: str = UID) -> dict[str, Any]:
    """A finished child TaskRun as listed (status Succeeded so the TaskRuns gate is open)."""
    return {
        "apiVersion": "tekton.dev/v1",
        "kind": "TaskRun",
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": f"{name}-uid",
            "labels": {"tekton.dev/pipelineRun": "build"},
            "annotations": annotations,
            "ownerReferences": [{"kind": "PipelineRun", "uid": owner, "controller": True}],
        },
        "status": {
            "completionTime": "2026-11-21T11:00:00Z",
            "conditions": [{"type": "Succeeded", "status": "True"}],
        },
    }


def safety(mode: str | bool) -> SafetyConfig:
    return SafetyConfig.model_validate({"wait_for_tekton_results": mode})


@pytest.mark.parametrize("kind", [TEKTON_PIPELINERUN, TEKTON_TASKRUN])
@pytest.mark.parametrize("stored", [None, "false", "yes"])
def test_a_run_the_watcher_reached_waits_for_the_stored_mark(kind: KindSpec, stored: str) -> None:
    closed = closed_gate(run(kind, watched(stored)), kind, SafetyConfig())
    assert closed is not None and closed.gate is Gate.TEKTON_RESULTS_STORED
    assert STORED in closed.reason and kind.kind in closed.reason


@pytest.mark.parametrize("kind", [TEKTON_PIPELINERUN, TEKTON_TASKRUN])
@pytest.mark.parametrize("mode", ["auto", True])
def test_the_stored_mark_opens_the_gate(kind: KindSpec, mode: str | bool) -> None:
    assert closed_gate(run(kind, watched("true")), kind, safety(mode)) is None


def test_auto_does_not_hold_a_run_without_any_results_annotation() -> None:
    """No watcher (or one that never reached the run): auto lets it go; true holds it."""
    plain = run(TEKTON_PIPELINERUN, {"lapse.dev/ttl": "1h"})
    assert closed_gate(plain, TEKTON_PIPELINERUN, safety("auto")) is None
    closed = closed_gate(plain, TEKTON_PIPELINERUN, safety(True))
    assert closed is not None and closed.gate is Gate.TEKTON_RESULTS_STORED


def test_false_never_holds() -> None:
    unstored = run(TEKTON_TASKRUN, watched("false"))
    assert closed_gate(unstored, TEKTON_TASKRUN, safety(False)) is None


def test_a_pipelinerun_waits_for_its_taskruns_to_be_stored() -> None:
    """Results' own finalizer waits for the children's marks too: their records are the
    PipelineRun's steps, and deleting the PipelineRun takes them with it."""
    parent = run(TEKTON_PIPELINERUN, watched("true"))
    children = [taskrun("build-fetch", watched("true")), taskrun("build-test", watched("false"))]
    closed = closed_gate(parent, TEKTON_PIPELINERUN, SafetyConfig(), children)
    assert closed is not None and closed.gate is Gate.TEKTON_RESULTS_STORED
    assert "build-test" in closed.reason and "build-fetch" not in closed.reason
    children[1]["metadata"]["annotations"] = watched("true")
    assert closed_gate(parent, TEKTON_PIPELINERUN, SafetyConfig(), children) is None


def test_auto_holds_a_pipelinerun_when_only_a_taskrun_shows_the_watcher() -> None:
    parent = run(TEKTON_PIPELINERUN, {})
    children = [taskrun("build-fetch", watched("true"))]
    closed = closed_gate(parent, TEKTON_PIPELINERUN, SafetyConfig(), children)
    assert closed is not None and "PipelineRun" in closed.reason


def test_a_taskrun_of_an_earlier_pipelinerun_with_the_same_name_is_not_counted() -> None:
    parent = run(TEKTON_PIPELINERUN, watched("true"))
    stale = [taskrun("build-old", watched("false"), owner="an-earlier-uid")]
    assert closed_gate(parent, TEKTON_PIPELINERUN, SafetyConfig(), stale) is None


def test_the_setting_accepts_only_auto_or_a_boolean() -> None:
    with pytest.raises(ValueError, match="wait_for_tekton_results"):
        safety("sometimes")
