"""Argo Workflows (including the ones Kubeflow Pipelines creates).

How a Workflow is read is data (`lapse.events.kinds.ARGO_WORKFLOW`); the constants here are
for callers that speak to Argo's API directly.
"""

from __future__ import annotations

from typing import Final

from lapse.events.adapters.objects import adapt
from lapse.events.adapters.result import Ignored
from lapse.events.kinds import ARGO_WORKFLOW
from lapse.events.models import RunDeleted, RunFinished

GROUP: Final = ARGO_WORKFLOW.group
VERSION: Final = ARGO_WORKFLOW.version
KIND: Final = ARGO_WORKFLOW.kind
RESOURCE: Final = ARGO_WORKFLOW.resource
DEFAULT_API_VERSION: Final = ARGO_WORKFLOW.api_version
# Argo sets this label to "true" when a Workflow reaches a terminal phase: selecting on it
# server-side keeps running workflows out of every list and watch.
COMPLETED_LABEL: Final = "workflows.argoproj.io/completed"
COMPLETED_SELECTOR: Final = f"{COMPLETED_LABEL}=true"
assert ARGO_WORKFLOW.finished_selector == COMPLETED_SELECTOR


def adapt_workflow(obj: object, deleted: bool = False) -> RunFinished | RunDeleted | Ignored:
    """An Argo Workflow object -> RunFinished (terminal phase), RunDeleted, or Ignored."""
    return adapt(obj, ARGO_WORKFLOW, deleted)
