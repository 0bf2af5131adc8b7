"""The Kubernetes edge: the API client, Argo Workflows, any referenced object, Events."""

from lapse.edges.kubernetes.client import (
    ApiCallFailure,
    api_failure,
    continue_after_expiry,
    load_api_client,
)
from lapse.edges.kubernetes.events import KubeEvents
from lapse.edges.kubernetes.objects import KubeObjects
from lapse.edges.kubernetes.workflows import (
    Page,
    WatchEvent,
    Workflows,
    finished_workflow_pages,
    list_workflow_metadata,
)

__all__ = [
    "ApiCallFailure",
    "KubeEvents",
    "KubeObjects",
    "Page",
    "WatchEvent",
    "Workflows",
    "api_failure",
    "continue_after_expiry",
    "finished_workflow_pages",
    "list_workflow_metadata",
    "load_api_client",
]
