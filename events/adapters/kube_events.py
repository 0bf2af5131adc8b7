"""Kubernetes Events (core/v1 and events.k8s.io/v1) that announce a finished Workflow.

The Argo controller records `WorkflowSucceeded` / `WorkflowFailed` (and `WorkflowTimedOut`
before the failure) with the Workflow as the involved object. The Event only names the
Workflow, so the result is a `NeedsFetch`; every other Event in the cluster is Ignored,
not invalid, because a source watching Events sees all of them.
"""

from __future__ import annotations

from typing import Final

from lapse.events.adapters import argo
from lapse.events.adapters.kube import api_group, as_object, child_object, optional_str
from lapse.events.adapters.result import Ignored, NeedsFetch
from lapse.events.errors import InvalidEvent

KIND: Final = "Event"
GROUPS: Final = frozenset({"", "events.k8s.io"})
FINISH_REASONS: Final = frozenset({"WorkflowSucceeded", "WorkflowFailed", "WorkflowTimedOut"})


def adapt_kubernetes_event(obj: object, deleted: bool = False) -> NeedsFetch | Ignored:
    """A Kubernetes Event -> NeedsFetch of the Workflow it announces finished, or Ignored."""
    event = as_object(obj, KIND)
    api_version = optional_str(event, "apiVersion", "Event apiVersion") or "v1"
    kind = event.get("kind", KIND)
    if api_group(api_version) not in GROUPS or kind != KIND:
        raise InvalidEvent(f"expected a Kubernetes Event, got {_short(api_version)} {_short(kind)}")
    if deleted:
        # Events expire (default 1 h); that says nothing about the run they mention.
        return Ignored("a Kubernetes Event was deleted")
    reason = event.get("reason")
    if not isinstance(reason, str) or reason not in FINISH_REASONS:
        return Ignored(f"Event reason {_short(reason)!r} does not announce a finished Workflow")
    # core/v1 names the object `involvedObject`; events.k8s.io/v1 calls it `regarding`.
    key = "regarding" if api_group(api_version) == "events.k8s.io" else "involvedObject"
    ref = child_object(event, key, f"Event {key}")
    ref_api_version = optional_str(ref, "apiVersion", f"Event {key}.apiVersion") or ""
    if api_group(ref_api_version) != argo.GROUP or ref.get("kind") != argo.KIND:
        return Ignored(
            f"Event {reason} is about {_short(ref_api_version)} {_short(ref.get('kind'))}"
        )
    meta = child_object(event, "metadata", "Event metadata")
    namespace = optional_str(ref, "namespace", f"Event {key}.namespace") or optional_str(
        meta, "namespace", "Event metadata.namespace"
    )
    name = optional_str(ref, "name", f"Event {key}.name")
    if not namespace or not name:
        raise InvalidEvent(f"Event {reason} does not name the Workflow's namespace and name")
    return NeedsFetch(
        api_version=ref_api_version,
        kind=argo.KIND,
        namespace=namespace,
        name=name,
        uid=optional_str(ref, "uid", f"Event {key}.uid") or None,
    )


def _short(value: object) -> str:
    return str(value)[:80]
