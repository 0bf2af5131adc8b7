"""Gates: conditions under which an expired Workflow must not be deleted yet (or here).

- Scope: lapse only touches namespaces that `safety.namespaces` includes and does not
  exclude.
- Argo archiving: while `workflow-archiving-status` is `Pending` the archive row is not
  written yet; deleting the object then loses the run from the archive.
- KFP: until the API server labels the Workflow `pipeline/persistedFinalState: "true"`,
  the run's final state is not in KFP's database; deleting the object first leaves the
  run RUNNING there forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase

from events.run import ARGO_ARCHIVING_LABEL, KFP_PERSISTED_LABEL, KFP_RUN_ID_LABEL
from functions.safety import NamespaceFilter, SafetyConfig


class Gate(StrEnum):
    ARGO_ARCHIVING = "argo-archiving"
    KFP_PERSISTED = "kfp-persisted-final-state"


@dataclass(frozen=True, slots=True)
class Closed:
    """A gate that holds the deletion back, and why (one line, names the label)."""

    gate: Gate
    reason: str


def out_of_scope(namespace: str, scope: NamespaceFilter) -> str | None:
    """Why lapse must not touch `namespace`, or None when it may."""
    excluded = next((p for p in scope.exclude if fnmatchcase(namespace, p)), None)
    if excluded is not None:
        return f"namespace {namespace!r} is excluded by safety.namespaces.exclude {excluded!r}"
    if not any(fnmatchcase(namespace, p) for p in scope.include):
        return f"namespace {namespace!r} matches no safety.namespaces.include pattern"
    return None


def closed_gate(labels: Mapping[str, str], safety: SafetyConfig) -> Closed | None:
    """The first gate that is still closed for an object with these labels, or None."""
    if safety.wait_for_archiving and labels.get(ARGO_ARCHIVING_LABEL) == "Pending":
        return Closed(
            Gate.ARGO_ARCHIVING, f"Argo archiving is still Pending ({ARGO_ARCHIVING_LABEL})"
        )
    run_id = labels.get(KFP_RUN_ID_LABEL)
    # Anything but the exact "true" KFP writes counts as not persisted: waiting is the
    # safe reading of a label lapse does not understand.
    if safety.wait_for_kfp_persisted and run_id and labels.get(KFP_PERSISTED_LABEL) != "true":
        return Closed(
            Gate.KFP_PERSISTED,
            f"KFP run {run_id} has no {KFP_PERSISTED_LABEL}: 'true' label yet "
            "(its final state is not in KFP's database)",
        )
    return None
