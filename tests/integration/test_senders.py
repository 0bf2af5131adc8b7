"""The functions' sender check (lapse/runtime/senders.py) against a real kube-apiserver:
tokens issued by it (TokenRequest) for the function's audience, reviewed by it
(TokenReview) with the rights the package ships (infra/knative/sender-auth.yaml, bound to
lapse-planner) and nothing more."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.runtime.senders import SenderCheck, bearer_header
from tests.conftest import KubeStack
from tests.infra_package import INFRA

pytestmark = pytest.mark.kube

SYSTEM = "lapse-system"
AUDIENCE = "serving.knative.dev/service/lapse-system/lapse-ttl-planner"


def account(kube: KubeStack, namespace: str, name: str) -> None:
    kube.namespace(namespace)
    core = client.CoreV1Api(kube.api_client)
    with contextlib.suppress(ApiException):
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
        )


def token(kube: KubeStack, namespace: str, name: str, audience: str | None) -> str:
    account(kube, namespace, name)
    spec = client.V1TokenRequestSpec(
        audiences=[audience] if audience else [], expiration_seconds=3600
    )
    answer = client.CoreV1Api(kube.api_client).create_namespaced_service_account_token(
        name, namespace, client.AuthenticationV1TokenRequest(spec=spec)
    )
    return str(answer.status.token)


@pytest.fixture
def check(kube: KubeStack, tmp_path: Path) -> SenderCheck:
    """lapse-planner's check, its own token (API audience) for the reviews, the shipped RBAC."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    role, binding = yaml.safe_load_all((INFRA / "knative/sender-auth.yaml").read_text())
    with contextlib.suppress(ApiException):
        rbac.create_cluster_role(role)
    with contextlib.suppress(ApiException):
        rbac.create_cluster_role_binding(binding)
    own = tmp_path / "token"
    own.write_text(token(kube, SYSTEM, "lapse-planner", None))
    return SenderCheck(
        AUDIENCE,
        [f"system:serviceaccount:{SYSTEM}:*"],
        api_server=kube.server.url,
        review_token=own,
        ca_file=kube.server.work_dir / "certs" / "apiserver.crt",
    )


def bearer(value: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"authorization", f"Bearer {value}".encode())]


async def test_only_a_token_for_the_audience_from_lapse_system_is_admitted(
    kube: KubeStack, check: SenderCheck
) -> None:
    trigger = token(kube, SYSTEM, "ttl-planner-oidc-trigger", AUDIENCE)
    assert await check.admit(bearer(trigger)) is None
    assert await check.admit(bearer(trigger)) is None  # remembered: no second review needed

    no_token = await check.admit([(b"content-type", b"application/json")])
    assert no_token is not None and no_token.status == 401

    stranger = await check.admit(bearer(token(kube, "elsewhere", "default", AUDIENCE)))
    assert stranger is not None and stranger.status == 403
    assert "system:serviceaccount:elsewhere:default" in stranger.reason

    other_audience = token(kube, SYSTEM, "ttl-planner-oidc-trigger", "other")
    wrong = await check.admit(bearer(other_audience))
    assert wrong is not None and wrong.status == 401

    api_token = await check.admit(bearer(token(kube, SYSTEM, "lapse-planner", None)))
    assert api_token is not None and api_token.status == 401

    forged = trigger.rsplit(".", 1)[0] + ".c2lnbmF0dXJl"
    refused = await check.admit(bearer(forged))
    assert refused is not None and refused.status == 401
    await check.close()


async def test_without_the_api_server_the_broker_is_asked_to_retry(
    kube: KubeStack, tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    own = tmp_path / "token"
    own.write_text("x")
    check = SenderCheck(
        AUDIENCE,
        ["*"],
        api_server=f"https://127.0.0.1:{port}",
        review_token=own,
        ca_file=kube.server.work_dir / "certs" / "apiserver.crt",
    )
    answer = await check.admit(bearer("a.b.c"))
    assert answer is not None and answer.status == 503 and answer.retry_after
    await check.close()


def test_the_check_is_configured_from_the_environment(tmp_path: Path) -> None:
    assert SenderCheck.from_env({}) is None  # `lapse serve` on a laptop: no check
    check = SenderCheck.from_env({"LAPSE_SENDER_AUDIENCE": AUDIENCE, "POD_NAMESPACE": SYSTEM})
    assert check is not None and check.subjects == (f"system:serviceaccount:{SYSTEM}:*",)
    file = tmp_path / "token"
    file.write_text("abc\n")
    assert bearer_header({"LAPSE_SINK_TOKEN_FILE": str(file)}) == {"Authorization": "Bearer abc"}
    assert bearer_header({}) == {}
