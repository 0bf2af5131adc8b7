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
    assert ensure(api, "lapse-nats-users", namespace) == "created"
    first = api.read_namespaced_secret("lapse-nats-users", namespace).data
    assert set(first) == {identity.user for identity in KUBERNETES}
    passwords = [base64.b64decode(value).decode() for value in first.values()]
    assert len(set(passwords)) == len(passwords)  # each its own
    assert all(len(p) >= 40 for p in passwords)  # over 250 random bits each
    # A rerun (an upgrade, a retried Job) keeps what is there.
    assert ensure(api, "lapse-nats-users", namespace) == "kept"
    assert api.read_namespaced_secret("lapse-nats-users", namespace).data == first


def test_an_upgrade_adds_the_key_of_a_new_identity_and_changes_no_other(
    kube: KubeStack,
) -> None:
    """A Secret made before an identity existed (lapse-artifact-reaper came in 0.2.0) gets
    that identity's key; every password that was there stays as it was."""
    api = client.CoreV1Api(kube.api_client)
    namespace = kube.namespace(f"nats-users-{uuid.uuid4().hex[:6]}")
    assert ensure(api, "lapse-nats-users", namespace) == "created"
    full = api.read_namespaced_secret("lapse-nats-users", namespace).data
    newest = KUBERNETES[-1].user
    older = {user: value for user, value in full.items() if user != newest}
    api.replace_namespaced_secret(
        "lapse-nats-users",
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name="lapse-nats-users"), data=older),
    )
    assert ensure(api, "lapse-nats-users", namespace) == f"added {newest}"
    after = api.read_namespaced_secret("lapse-nats-users", namespace).data
    assert set(after) == set(full)
    assert {user: after[user] for user in older} == older
