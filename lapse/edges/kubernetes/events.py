"""Kubernetes Events about the objects lapse deletes (`kubectl describe`, `get events`)."""

from __future__ import annotations

import functools
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import describe_api_error, request, server_attributes

log = logging.getLogger(__name__)


class KubeEvents:
    """Writes core/v1 Events, the ones `kubectl describe` and `kubectl get events` show.
    Best effort: a failure is logged, never raised (functions/object_reaper/ports.py)."""

    # Named the way client-go names them, <object>.<unique>, within the 253-char limit.
    _NAME_LIMIT = 253

    def __init__(
        self,
        api_client: client.ApiClient,
        executor: ThreadPoolExecutor,
        *,
        component: str = "lapse",
        instance: str | None = None,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._executor = executor
        self._server = server_attributes(api_client)
        self._component = component
        self._instance = instance or component

    async def record(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        api_version: str,
        kind: str,
        reason: str,
        message: str,
        event_type: str = "Normal",
    ) -> None:
        now = datetime.now(UTC)
        suffix = secrets.token_hex(8)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{name[: self._NAME_LIMIT - len(suffix) - 1]}.{suffix}", namespace=namespace
            ),
            involved_object=client.V1ObjectReference(
                api_version=api_version, kind=kind, name=name, namespace=namespace, uid=uid
            ),
            reason=reason,
            message=message[:1024],
            type=event_type,
            source=client.V1EventSource(component=self._component),
            reporting_component=self._component,
            reporting_instance=self._instance,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            await request(
                self._executor,
                self._server,
                "POST",
                "/api/v1/namespaces/{namespace}/events",
                namespace,
                functools.partial(
                    self._api.create_namespaced_event_with_http_info, namespace, event
                ),
            )
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            # Best effort: the outcome event is the record that matters, and a missing
            # Kubernetes Event must not turn a deletion into a retry.
            log.warning(
                "could not record a Kubernetes Event for %s/%s: %s",
                namespace, name, describe_api_error(exc),
            )  # fmt: skip
