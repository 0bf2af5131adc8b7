"""The comparison benchmark's janitor against a real API server: a sweep whose list outlives
its continue token starts the list over and still deletes every expired Workflow.

At `make bench`'s default backlog (100,000 objects, deleted one at a time) a sweep takes
longer than the API server's 5-minute compaction; its next page was then refused with 410
Gone and the whole benchmark stopped at the janitor. Here etcd is compacted between the
first and the second page (no watch cache for Workflows, so pages are read from etcd).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from bench.janitor import client_from_kubeconfig, sweep
from lapse.edges.kubernetes import load_api_client
from lapse.embedded.kube import EmbeddedKube, argo_workflow_crd
from tests.conftest import install_crd
from tests.integration.test_watcher import compact_etcd
from tests.stack import expired_workflow

pytestmark = pytest.mark.kube

NAMESPACE = "sweep"
PLURAL = ("argoproj.io", "v1alpha1", NAMESPACE, "workflows")


@pytest.fixture
def uncached_kube(tmp_path: Path) -> Iterator[tuple[EmbeddedKube, client.ApiClient]]:
    server = EmbeddedKube(
        tmp_path / "kube", extra_args=("--watch-cache-sizes=workflows.argoproj.io#0",)
    ).start()
    api = load_api_client(str(server.kubeconfig_path))
    install_crd(api, argo_workflow_crd())
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        yield server, api
    finally:
        api.close()
        server.stop()


def test_a_sweep_whose_continue_token_expired_lists_again(
    uncached_kube: tuple[EmbeddedKube, client.ApiClient], capsys: pytest.CaptureFixture[str]
) -> None:
    server, api = uncached_kube
    objects = client.CustomObjectsApi(api)
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
            # A write moves the revision past the list's snapshot; compaction then drops it.
            client.CoreV1Api(api).create_namespaced_config_map(
                NAMESPACE, {"metadata": {"name": "revision"}}
            )
            compact_etcd(server.etcd_url)

    with client_from_kubeconfig(server.kubeconfig_path) as janitor:
        listed, deleted = sweep(janitor, NAMESPACE, page_size=2, events=False, answered=answered)

    assert "continue token expired (410)" in capsys.readouterr().out
    assert deleted == 6
    assert listed == 6  # the first page's 2, then the 4 left, listed again
    assert objects.list_namespaced_custom_object(*PLURAL)["items"] == []
