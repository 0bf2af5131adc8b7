"""The Kubernetes edge: the API client, run objects of every configured kind (and Argo
Workflows by name), Events."""

from lapse.edges.kubernetes.client import (
    ApiCallFailure,
    api_failure,
    continue_after_expiry,
    load_api_client,
)
from lapse.edges.kubernetes.events import KubeEvents
from lapse.edges.kubernetes.namespaces import finished_pages_within, namespace_names
from lapse.edges.kubernetes.objects import (
    KubeObjects,
    Page,
    WatchEvent,
    finished_pages,
    list_metadata,
)
from lapse.edges.kubernetes.own_deletions import OwnDeletions
from lapse.edges.kubernetes.workflows import Workflows, finished_workflow_pages

__all__ = [
    "ApiCallFailure",
    "KubeEvents",
    "KubeObjects",
    "OwnDeletions",
    "Page",
    "WatchEvent",
    "Workflows",
    "api_failure",
    "continue_after_expiry",
    "finished_pages",
    "finished_pages_within",
    "finished_workflow_pages",
    "list_metadata",
    "load_api_client",
    "namespace_names",
]
