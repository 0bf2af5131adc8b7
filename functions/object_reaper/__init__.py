"""object-reaper: deletes a run object of any configured kind (Argo Workflow, Tekton
PipelineRun or TaskRun, Job, TrainJob, or a declared one) when its Kubernetes deadline
comes due, after re-checking everything that could make the deletion wrong."""

from lapse.functions.object_reaper.handler import SOURCE, ObjectReaper
from lapse.functions.object_reaper.ports import EventRecorder, ObjectAccess
from lapse.functions.object_reaper.verdict import Verdict, as_planned, classify

__all__ = [
    "SOURCE",
    "EventRecorder",
    "ObjectAccess",
    "ObjectReaper",
    "Verdict",
    "as_planned",
    "classify",
]
