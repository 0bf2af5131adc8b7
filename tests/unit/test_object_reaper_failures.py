"""What a failed API call means to the object reaper, as its edge maps it into the one
failure hierarchy (functions/reaping/failures.py): retry later, or fail loudly (RBAC above
all).

The ApiExceptions here are built from real urllib3 responses carrying the bodies the
kube-apiserver sends, because 429s and 5xx cannot be provoked from a healthy test server;
403 is provoked for real in tests/integration/test_object_reaper.py.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTResponse

from lapse.edges.kubernetes import ApiCallFailure, api_failure
from lapse.edges.kubernetes.reaping import failure_of
from lapse.events.kinds import ARGO_WORKFLOW, KindSpec
from lapse.events.run import Engine, RunRef
from lapse.functions.ports import RetryLater
from lapse.functions.reaping.failures import Refused, Unavailable

RUN = RunRef(
    engine=Engine.ARGO,
    api_version="argoproj.io/v1alpha1",
    kind="Workflow",
    namespace="team-a",
    name="wf",
    uid=str(uuid.uuid4()),
    phase="Succeeded",
    finished_at=datetime(2026, 11, 21, tzinfo=UTC),
)


def judge_failure(failure: ApiCallFailure, verb: str, run: RunRef, kind: KindSpec) -> Refused:
    """The failure as the reaper meets it: raised if transient, returned if refused."""
    mapped = failure_of(failure, verb, kind, run.namespace, run.name)
    if isinstance(mapped, Unavailable):
        raise mapped
    assert isinstance(mapped, Refused), mapped
    return mapped


def api_exception(status: int, message: str, headers: dict[str, str] | None = None) -> ApiException:
    body = json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "code": status,
        }
    ).encode()
    response = urllib3.HTTPResponse(
        body=body, headers=headers or {}, status=status, preload_content=True
    )
    rest = RESTResponse(response)
    rest.data = body
    return ApiException(http_resp=rest)


def test_forbidden_names_the_permission_and_fails() -> None:
    message = (
        'workflows.argoproj.io "wf" is forbidden: User "lapse-readonly" cannot delete resource '
        '"workflows" in API group "argoproj.io" in the namespace "team-a"'
    )
    failure = api_failure(api_exception(403, message))
    assert failure == ApiCallFailure(403, message, None)
    verdict = judge_failure(failure, "delete", RUN, ARGO_WORKFLOW)
    assert isinstance(verdict, Refused)
    assert verdict.reason.startswith("forbidden: ")
    assert 'User "lapse-readonly" cannot delete' in verdict.reason
    assert "'delete' verb on workflows.argoproj.io in namespace 'team-a'" in verdict.reason


def test_unauthorized_fails() -> None:
    verdict = judge_failure(ApiCallFailure(401, "Unauthorized"), "get", RUN, ARGO_WORKFLOW)
    assert isinstance(verdict, Refused) and verdict.reason.startswith("unauthorized: ")


def test_too_many_requests_retries_after_what_the_server_said() -> None:
    failure = api_failure(api_exception(429, "too many requests", {"Retry-After": "7"}))
    assert failure is not None and failure.retry_after == 7.0
    with pytest.raises(RetryLater) as raised:
        judge_failure(failure, "delete", RUN, ARGO_WORKFLOW)
    assert raised.value.delay == 7.0
    assert "HTTP 429" in raised.value.reason


@pytest.mark.parametrize(("retry_after", "delay"), [(None, 5.0), (0.0, 1.0), (86400.0, 300.0)])
def test_retry_delay_is_bounded(retry_after: float | None, delay: float) -> None:
    with pytest.raises(RetryLater) as raised:
        judge_failure(
            ApiCallFailure(503, "etcd leader changed", retry_after), "get", RUN, ARGO_WORKFLOW
        )
    assert raised.value.delay == delay


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
def test_server_side_trouble_is_retried(status: int) -> None:
    with pytest.raises(RetryLater):
        judge_failure(ApiCallFailure(status, "x"), "delete", RUN, ARGO_WORKFLOW)


def test_no_response_is_retried() -> None:
    error = urllib3.exceptions.MaxRetryError(None, "/apis", reason=ConnectionRefusedError())  # type: ignore[arg-type]
    failure = api_failure(error)
    assert failure is not None and failure.status is None
    with pytest.raises(RetryLater, match="no response"):
        judge_failure(failure, "get", RUN, ARGO_WORKFLOW)
    assert api_failure(ConnectionResetError()) is not None


@pytest.mark.parametrize("status", [400, 405, 422])
def test_other_client_errors_fail_with_the_status(status: int) -> None:
    verdict = judge_failure(ApiCallFailure(status, "bad"), "delete", RUN, ARGO_WORKFLOW)
    assert isinstance(verdict, Refused) and f"HTTP {status}" in verdict.reason


def test_bugs_are_not_mistaken_for_api_failures() -> None:
    assert api_failure(KeyError("metadata")) is None
    assert api_failure(ApiException(status=500, reason="Internal")) == ApiCallFailure(
        500, "Internal", None
    )
