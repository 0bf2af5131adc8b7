"""workflow-reaper: deletes an Argo Workflow when its Kubernetes deadline comes due, after
re-checking everything that could make the deletion wrong."""

from functions.workflow_reaper.handler import SOURCE, WorkflowReaper
from functions.workflow_reaper.ports import CallFailure, EventRecorder, WorkflowAccess
from functions.workflow_reaper.verdict import Verdict, classify

__all__ = [
    "SOURCE",
    "CallFailure",
    "EventRecorder",
    "Verdict",
    "WorkflowAccess",
    "WorkflowReaper",
    "classify",
]
