"""Choose the adapter for an object or an incoming CloudEvent."""

from __future__ import annotations

from typing import Any, Final

from cloudevents.core.base import BaseCloudEvent

from lapse.events.adapters import kube_events, tekton
from lapse.events.adapters.kube import api_group, as_object, optional_str, required_str
from lapse.events.adapters.objects import adapt
from lapse.events.adapters.result import AdapterResult, Ignored, NeedsFetch
from lapse.events.builder import parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.jsontext import is_json_media_type, parse_json
from lapse.events.kinds import DEFAULT_KINDS, KindSet, KindSpec, UnknownKind
from lapse.events.models import RunDeleted, RunFinished
from lapse.events.types import EventType

KNATIVE_RESOURCE_EVENTS: Final = {
    "dev.knative.apiserver.resource.add": False,
    "dev.knative.apiserver.resource.update": False,
    "dev.knative.apiserver.resource.delete": True,
}
KNATIVE_REF_EVENTS: Final = {
    "dev.knative.apiserver.ref.add": False,
    "dev.knative.apiserver.ref.update": False,
    "dev.knative.apiserver.ref.delete": True,
}

_KUBE_EVENT_KINDS: Final = frozenset((group, kube_events.KIND) for group in kube_events.GROUPS)


def adapt_object(
    obj: object, deleted: bool = False, kinds: KindSet = DEFAULT_KINDS
) -> AdapterResult:
    """A Kubernetes object (with apiVersion and kind): a run of one of `kinds`, or a
    Kubernetes Event announcing one. Any other kind is refused with the reason."""
    group_kind = _group_kind(as_object(obj, "object"), "object")
    if group_kind in _KUBE_EVENT_KINDS:
        return kube_events.adapt_kubernetes_event(obj, deleted)
    return adapt(obj, _spec(kinds, obj), deleted)


def adapt_cloudevent(event: BaseCloudEvent, kinds: KindSet = DEFAULT_KINDS) -> AdapterResult:
    """Any CloudEvent lapse accepts as run input, chosen by its `type`.

    Already-normalized `dev.lapse.run.finished/deleted.v1` events pass through validated,
    so a producer that speaks lapse's contract needs no adapter.
    """
    event_type = event.get_type()
    if event_type in KNATIVE_RESOURCE_EVENTS:
        return adapt_object(_data(event), KNATIVE_RESOURCE_EVENTS[event_type], kinds)
    if event_type in KNATIVE_REF_EVENTS:
        return _from_reference(_data(event), KNATIVE_REF_EVENTS[event_type], kinds)
    if event_type.startswith(tekton.EVENT_PREFIX):
        return tekton.adapt_tekton_event(event_type, _data(event), kinds)
    if event_type == EventType.RUN_FINISHED:
        return parse_payload(event, RunFinished)
    if event_type == EventType.RUN_DELETED:
        return parse_payload(event, RunDeleted)
    raise InvalidEvent(f"unsupported event type {event_type!r}")


def _from_reference(data: Any, deleted: bool, kinds: KindSet) -> NeedsFetch | Ignored:
    """Knative ApiServerSource Reference mode: data is an ObjectReference, nothing more."""
    ref = as_object(data, "ApiServerSource reference")
    group_kind = _group_kind(ref, "reference")
    if group_kind in _KUBE_EVENT_KINDS:
        if deleted:
            return Ignored("a Kubernetes Event was deleted")
    else:
        _spec(kinds, ref)
    return NeedsFetch(
        api_version=required_str(ref, "apiVersion", "reference apiVersion"),
        kind=group_kind[1],
        namespace=required_str(ref, "namespace", "reference namespace"),
        name=required_str(ref, "name", "reference name"),
        uid=optional_str(ref, "uid", "reference uid") or None,
        deleted=deleted,
    )


def _spec(kinds: KindSet, obj: Any) -> KindSpec:
    try:
        return kinds.of(
            required_str(obj, "apiVersion", "apiVersion"), required_str(obj, "kind", "kind")
        )
    except UnknownKind as exc:
        raise InvalidEvent(str(exc)) from None


def _group_kind(obj: dict[str, Any], where: str) -> tuple[str, str]:
    api_version = required_str(obj, "apiVersion", f"{where} apiVersion")
    return api_group(api_version), required_str(obj, "kind", f"{where} kind")


def _data(event: BaseCloudEvent) -> Any:
    content_type = event.get_datacontenttype()
    if content_type is not None and not is_json_media_type(content_type):
        raise InvalidEvent(f"{event.get_type()}: datacontenttype {content_type!r} is not JSON")
    data = event.get_data()
    if isinstance(data, str | bytes):
        try:
            return parse_json(data)
        except ValueError as exc:
            raise InvalidEvent(f"{event.get_type()}: data is {exc}") from None
    if data is None:
        raise InvalidEvent(f"{event.get_type()}: event has no data")
    return data
