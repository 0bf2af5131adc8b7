"""The Job of the dev NATS (`python -m lapse.operations.nats_users`) on a real API server:
it creates the Secret with a password per identity, and never changes one that exists."""

from __future__ import annotations

import base64
import uuid

import pytest
from kubernetes import client

from lapse.embedded.nats_identities import KUBERNETES
from lapse.operations.nats_users import ensure
from tests.conftest import KubeStack

pytestmark = [pytest.mark.kube]


def test_the_secret_is_made_once_with_a_password_per_identity(kube: KubeStack) -> None:
    api = client.CoreV1Api(kube.api_client)
    namespace = kube.namespace(f"nats-users-{uuid.uuid4().hex[:6]}")
    assert ensure(api, "lapse-nats-users", namespace) is True
    first = api.read_namespaced_secret("lapse-nats-users", namespace).data
    assert set(first) == {identity.user for identity in KUBERNETES}
    passwords = [base64.b64decode(value).decode() for value in first.values()]
    assert len(set(passwords)) == len(passwords)  # each its own
    assert all(len(p) >= 40 for p in passwords)  # 32 random bytes, URL-safe base64
    # A rerun (an upgrade, a retried Job) keeps what is there.
    assert ensure(api, "lapse-nats-users", namespace) is False
    assert api.read_namespaced_secret("lapse-nats-users", namespace).data == first
