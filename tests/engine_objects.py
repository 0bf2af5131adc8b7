"""Objects as the engines' controllers write them, for tests that write runs themselves.
Each is held to what the real controller wrote on the test cluster
(tests/fixtures/engines/, tests/unit/test_engine_fixtures.py)."""

from __future__ import annotations

from typing import Any


def succeeded_job_status(started: str, finished: str) -> dict[str, Any]:
    """A succeeded Job's status exactly as the Job controller writes it (Kubernetes v1.35):
    SuccessCriteriaMet, then Complete, with its reason, message and probe time;
    completionTime the Complete condition's time."""
    conditions = [
        {
            "type": kind, "status": "True", "reason": "CompletionsReached",
            "message": "Reached expected number of succeeded pods",
            "lastProbeTime": finished, "lastTransitionTime": finished,
        }
        for kind in ("SuccessCriteriaMet", "Complete")
    ]  # fmt: skip
    return {
        "startTime": started, "completionTime": finished, "succeeded": 1, "ready": 0,
        "terminating": 0, "uncountedTerminatedPods": {}, "conditions": conditions,
    }  # fmt: skip
