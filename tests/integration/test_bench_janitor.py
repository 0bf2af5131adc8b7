"""The comparison benchmark's janitor against a real API server: a sweep whose list outlives
its continue token starts the list over and still deletes every expired Workflow.

At `make bench`'s default backlog (100,000 objects, deleted one at a time) a sweep takes
longer than the API server's 5-minute compaction; its next page was then refused with 410
Gone and the whole benchmark stopped at the janitor. Here etcd is compacted between the
first and the second page (no watch cache for Workflows, so pages are read from etcd).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from bench.janitor import client_from_kubeconfig, sweep
from tests.conftest import KubeStack, compact_etcd
from tests.stack import expired_workflow

pytestmark = pytest.mark.kube

NAMESPACE = "sweep"
PLURAL = ("argoproj.io", "v1alpha1", NAMESPACE, "workflows")


def test_a_sweep_whose_continue_token_expired_lists_again(
    uncached_kube: KubeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = uncached_kube
    stack.namespace(NAMESPACE)
    objects = client.CustomObjectsApi(stack.api_client)
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    for i in range(6):
        body: dict[str, Any] = expired_workflow(f"w{i}", long_ago)
        body["spec"]["ttlStrategy"] = {"secondsAfterCompletion": 1}
        objects.create_namespaced_custom_object(*PLURAL, body)
    pages = 0

    def answered() -> None:
        nonlocal pages
        pages += 1
        if pages == 1:
            # A write moves the revision past the list's snapshot; compaction drops it.
            client.CoreV1Api(stack.api_client).create_namespaced_config_map(
                NAMESPACE, {"metadata": {"name": "revision"}}
            )
            compact_etcd(stack.server.etcd_url)

    with client_from_kubeconfig(stack.kubeconfig) as janitor:
        listed, deleted = sweep(janitor, NAMESPACE, 2, events=False, answered=answered)

    assert "continue token expired (410)" in capsys.readouterr().out
    assert deleted == 6
    assert listed == 6  # the first page's 2, then the 4 left, listed again
    assert objects.list_namespaced_custom_object(*PLURAL)["items"] == []
