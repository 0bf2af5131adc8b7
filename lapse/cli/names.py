"""The closed sets the command line's flags take, written out: defining a flag (and printing
`--help`, completing a value) must not import the event models, the registry of functions
or NATS (docs/cli.md, "Start-up"). tests/unit/test_cli_names.py keeps each equal to the
set it mirrors."""

from __future__ import annotations

from typing import Final

# lapse.events.run.Target
TARGETS: Final = ("kubernetes", "database", "artifacts")
# lapse.events.types.Outcome, and "failed" (a cleanup.failed, in `lapse history`)
OUTCOMES: Final = (
    "deleted", "already_gone", "dry_run", "kept", "rescheduled", "replaced", "skipped",
    "refused", "failed",
)  # fmt: skip
# lapse.runtime.registry.FUNCTIONS
FUNCTIONS: Final = ("artifact-reaper", "object-reaper", "row-reaper", "ttl-planner")
# lapse.edges.limits.SCOPES: each target's brake
BRAKE_TARGETS: Final = ("artifacts", "database", "kubernetes")
# lapse.events.kinds.BUILTIN_KINDS: names and Kubernetes kinds (a configured kind of another
# name is still accepted; these are what completion offers)
KNOWN_KINDS: Final = (
    "argo-workflow", "tekton-pipelinerun", "tekton-taskrun", "job", "trainjob", "rayjob",
    "jobset", "sparkapplication",
    "Workflow", "PipelineRun", "TaskRun", "Job", "TrainJob", "RayJob", "JobSet",
    "SparkApplication",
)  # fmt: skip
