"""`kubernetes.qps` / `burst`, as a command gets them: a client-side token bucket on every
API request, applied when either key is set (before 0.2 they did nothing)."""

from __future__ import annotations

import pytest
from kubernetes import client

from lapse.config import load_config
from lapse.edges.kubernetes.client import RateLimitedApiClient
from lapse.runtime.resources import Resources
from tests.conftest import KubeStack

pytestmark = [pytest.mark.kube]


def _client(kube: KubeStack, env: dict[str, str]) -> client.ApiClient:
    config = load_config(env={"LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig), **env})
    return Resources(config).kube_client()


def test_a_set_qps_makes_requests_wait_for_tokens(kube: KubeStack) -> None:
    # One token every 2 s, one at once: the second request waits (unless the first took
    # over 2 s, which a loopback list does not).
    api_client = _client(kube, {"LAPSE_KUBERNETES__QPS": "0.5", "LAPSE_KUBERNETES__BURST": "1"})
    assert isinstance(api_client, RateLimitedApiClient)
    core = client.CoreV1Api(api_client)
    core.list_namespace(limit=1)
    assert api_client.limiter.delayed == 0
    core.list_namespace(limit=1)
    assert api_client.limiter.delayed == 1
    api_client.close()


def test_unset_keys_add_no_limit(kube: KubeStack) -> None:
    api_client = _client(kube, {})
    assert not isinstance(api_client, RateLimitedApiClient)
    client.CoreV1Api(api_client).list_namespace(limit=1)
    api_client.close()
