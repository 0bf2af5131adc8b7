"""Gates: conditions under which an expired object must not be deleted yet (or here).
Each kind names the gates that apply to it (`KindSpec.gates`, events/kinds.py).

- Argo archiving: while `workflow-archiving-status` is `Pending` the archive row is not
  written yet; deleting the object then loses the run from the archive.
- KFP: until the API server labels the Workflow `pipeline/persistedFinalState: "true"`,
  the run's final state is not in KFP's database; deleting the object first leaves the
  run RUNNING there forever.
- Tekton TaskRuns: a PipelineRun is final (cancelled, timed out) while its TaskRuns may
  still be stopping; deleting it then cuts their Pods off mid-cleanup. Its TaskRuns are
  the ones labelled `tekton.dev/pipelineRun=<name>` and controlled by its uid.
- Tekton Results: the Results watcher upserts a run's record, annotates the run
  `results.tekton.dev/record` and `results.tekton.dev/result`, and once the run is done and
  its final state stored, `results.tekton.dev/stored: "true"` (tektoncd/results,
  pkg/watcher/reconciler/dynamic: addStoredAnnotations). Deleting the run before that loses
  it from Results. A PipelineRun also waits for its TaskRuns' marks, as Results' own
  finalizer does (their records are the PipelineRun's steps). `safety.wait_for_tekton_results`:
  true holds every run until marked; auto holds the runs the watcher has visibly reached (any
  `results.tekton.dev/` annotation on the run or its TaskRuns); false never holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lapse.events.adapters.objects import RUNNING, read_run
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import TEKTON_TASKRUN, Gate, KindSpec
from lapse.events.run import ARGO_ARCHIVING_LABEL, KFP_PERSISTED_LABEL, KFP_RUN_ID_LABEL, RunRef
from lapse.functions.safety import SafetyConfig

TEKTON_PIPELINERUN_LABEL: Final = "tekton.dev/pipelineRun"
RESULTS_PREFIX: Final = "results.tekton.dev/"
RESULTS_STORED: Final = RESULTS_PREFIX + "stored"


@dataclass(frozen=True, slots=True)
class Closed:
    """A gate that holds the deletion back, and why (one line, names the label)."""

    gate: Gate
    reason: str


def needs_children(kind: KindSpec) -> bool:
    """Whether deciding this kind's gates needs its child objects read (one LIST)."""
    return Gate.TEKTON_TASKRUNS in kind.gates


def children_selector(run: RunRef) -> str:
    return f"{TEKTON_PIPELINERUN_LABEL}={run.name}"


def closed_gate(
    run: RunRef,
    kind: KindSpec,
    safety: SafetyConfig,
    children: Sequence[Mapping[str, Any]] = (),
) -> Closed | None:
    """The first of the kind's gates that is still closed for this run, or None."""
    for gate in kind.gates:
        closed = _check(gate, run, safety, children)
        if closed is not None:
            return closed
    return None


def _check(
    gate: Gate, run: RunRef, safety: SafetyConfig, children: Sequence[Mapping[str, Any]]
) -> Closed | None:
    labels = run.labels
    if gate is Gate.ARGO_ARCHIVING:
        if safety.wait_for_archiving and labels.get(ARGO_ARCHIVING_LABEL) == "Pending":
            return Closed(gate, f"Argo archiving is still Pending ({ARGO_ARCHIVING_LABEL})")
    elif gate is Gate.KFP_PERSISTED:
        run_id = labels.get(KFP_RUN_ID_LABEL)
        # Anything but the exact "true" KFP writes counts as not persisted: waiting is the
        # safe reading of a label lapse does not understand.
        if safety.wait_for_kfp_persisted and run_id and labels.get(KFP_PERSISTED_LABEL) != "true":
            return Closed(
                gate,
                f"KFP run {run_id} has no {KFP_PERSISTED_LABEL}: 'true' label yet "
                "(its final state is not in KFP's database)",
            )
    elif gate is Gate.TEKTON_TASKRUNS:
        running = unfinished_children(run, children)
        if running:
            shown = ", ".join(running[:5]) + (" ..." if len(running) > 5 else "")
            return Closed(gate, f"{len(running)} TaskRun(s) still running: {shown}")
    elif gate is Gate.TEKTON_RESULTS_STORED:
        return _results_not_stored(run, safety, children)
    return None


def _results_not_stored(
    run: RunRef, safety: SafetyConfig, children: Sequence[Mapping[str, Any]]
) -> Closed | None:
    mode = safety.wait_for_tekton_results
    if mode is False:
        return None
    marks: list[tuple[str, Mapping[str, Any]]] = [("", run.annotations)]
    marks += [
        (str(_metadata(c).get("name")), _annotations(c)) for c in children if _owned_by(run, c)
    ]
    if mode == "auto" and not any(k.startswith(RESULTS_PREFIX) for _, a in marks for k in a):
        return None  # the Results watcher has not reached this run (or is not installed)
    # Anything but the exact "true" the watcher writes counts as not stored.
    unstored = [name for name, annotations in marks if annotations.get(RESULTS_STORED) != "true"]
    if not unstored:
        return None
    if unstored[0] == "":
        return Closed(
            Gate.TEKTON_RESULTS_STORED,
            f"Tekton Results has not stored the {run.kind} yet (no {RESULTS_STORED}: 'true')",
        )
    shown = ", ".join(unstored[:5]) + (" ..." if len(unstored) > 5 else "")
    return Closed(
        Gate.TEKTON_RESULTS_STORED,
        f"Tekton Results has not stored {len(unstored)} TaskRun(s) yet "
        f"(no {RESULTS_STORED}: 'true'): {shown}",
    )


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    annotations = _metadata(obj).get("annotations")
    return annotations if isinstance(annotations, Mapping) else {}


def _owned_by(run: RunRef, child: Mapping[str, Any]) -> bool:
    """Whether `child` is controlled by this run (not an earlier run of the same name)."""
    owners = _metadata(child).get("ownerReferences")
    return isinstance(owners, list) and any(
        isinstance(o, Mapping) and o.get("uid") == run.uid for o in owners
    )


def unfinished_children(run: RunRef, children: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the run's TaskRuns that have not finished. A TaskRun that cannot be read
    counts as running: waiting is the safe reading."""
    running = []
    for child in children:
        if not _owned_by(run, child):
            continue  # a TaskRun of an earlier PipelineRun that had the same name
        metadata = _metadata(child)
        try:
            phase = read_run(dict(child), TEKTON_TASKRUN)[0].phase
        except InvalidEvent:
            phase = RUNNING
        if phase == RUNNING:
            running.append(str(metadata.get("name")))
    return running
