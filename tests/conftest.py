"""Session fixtures: real NATS, PostgreSQL, MariaDB and a kube-apiserver with etcd.

Each server starts the first time a test asks for it and stops at the end of the session;
unit tests ask for none of them and start nothing.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges import nats, streams
from lapse.edges.kubernetes import Workflows, load_api_client
from lapse.embedded.kube import EmbeddedKube, policy_crds, run_kind_crds
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import EmbeddedSeaweedFS
from tests.stack import Database, scratch_database

# What `make test` builds in the background while the other tests run (scripts/build-late.sh:
# helm, ML Metadata's venv, the images, SeaweedFS, the observability backends): the tests
# that need one of them are marked `late_build` and run in a second session, after those
# builds (Makefile, "test"; docs/install.md). On warm caches the split costs a second start.
LATE_BUILD_MODULES: frozenset[str] = frozenset(
    {
        "tests.integration.test_chart",  # helm
        "tests.integration.test_ml_metadata",  # the MLMD venv
        "tests.integration.test_images",  # the images
        "tests.integration.test_release",  # the images, helm
        "tests.integration.test_alert_rules",  # Prometheus' promtool
        "tests.integration.test_otel_collector",  # the Collector
        "tests.e2e.test_real_backends",  # the Collector, Prometheus, Jaeger
        "tests.e2e.test_artifacts_up",  # SeaweedFS, in the ones below too
        "tests.e2e.test_up_embedded_s3",
        "tests.e2e.test_demo",
        "tests.e2e.test_footprint_kfp",
        "tests.e2e.test_footprint_tekton",
    }
)
LATE_BUILD_FIXTURES: frozenset[str] = frozenset({"seaweedfs"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        late = module is not None and module.__name__ in LATE_BUILD_MODULES
        if late or LATE_BUILD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.late_build)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server of the test's own: for a `lapse up` (it creates the default streams,
    which other tests also use) or a test that owns every stream's contents."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


ARTIFACT_BUCKET = "lapse-artifacts"


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedSeaweedFS]:
    """A SeaweedFS S3 server (`make seaweedfs` builds it) with one bucket."""
    server = EmbeddedSeaweedFS(
        tmp_path_factory.mktemp("seaweedfs"), buckets=(ARTIFACT_BUCKET,)
    ).start()
    yield server
    server.stop()


@dataclass
class KubeStack:
    server: EmbeddedKube
    api_client: client.ApiClient
    kubeconfig: Path
    workflows: Workflows
    executor: ThreadPoolExecutor

    def namespace(self, name: str) -> str:
        """Create a namespace (idempotent) and return its name."""
        core = client.CoreV1Api(self.api_client)
        try:
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        except ApiException as exc:
            if exc.status != 409:
                raise
        return name


def install_crd(api_client: client.ApiClient, crd: dict[str, object]) -> None:
    ext = client.ApiextensionsV1Api(api_client)
    ext.create_custom_resource_definition(crd)
    name = crd["metadata"]["name"]  # type: ignore[index]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ext.read_custom_resource_definition(name).status
        if any(c.type == "Established" and c.status == "True" for c in status.conditions or []):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"CRD {name} never became Established")
    # Established is not yet served: until its watch cache is ready, a LIST answers 429
    # "storage is (re)initializing", which a test would take for a throttled API server.
    spec: Any = crd["spec"]
    objects = client.CustomObjectsApi(api_client)
    while time.monotonic() < deadline:
        try:
            for version in spec["versions"]:
                if version.get("served", True):
                    objects.list_cluster_custom_object(
                        spec["group"], version["name"], spec["names"]["plural"], limit=1
                    )
            return
        except ApiException as exc:
            if exc.status != 429:
                raise
        time.sleep(0.2)
    raise RuntimeError(f"CRD {name} never served a LIST")


@contextlib.contextmanager
def kube_stack(work_dir: Path, extra_args: tuple[str, ...] = ()) -> Iterator[KubeStack]:
    """etcd + kube-apiserver with the CRDs of every built-in kind installed (Argo
    Workflows, Tekton PipelineRuns and TaskRuns, TrainJobs, RayJobs, JobSets,
    SparkApplications) and lapse's own policy CRDs, stopped on exit."""
    server = EmbeddedKube(work_dir, extra_args=extra_args).start()
    api_client = load_api_client(str(server.kubeconfig_path))
    for crd in [*run_kind_crds(opt_in=True), *policy_crds()]:
        install_crd(api_client, crd)
    executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kube-test")
    try:
        yield KubeStack(
            server, api_client, server.kubeconfig_path, Workflows(api_client, executor), executor
        )
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        api_client.close()
        server.stop()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube")) as stack:
        yield stack


@pytest.fixture
def uncached_kube(tmp_path: Path) -> Iterator[KubeStack]:
    """A kube stack of the test's own with no watch cache for Workflows: watches and list
    pages are served by etcd, so `compact_etcd` makes an old resourceVersion or continue
    token answer 410 Gone, as a long disconnect or a long listing on a busy cluster does."""
    no_cache = ("--watch-cache-sizes=workflows.argoproj.io#0",)
    with kube_stack(tmp_path / "kube", extra_args=no_cache) as stack:
        yield stack


def compact_etcd(etcd_url: str) -> None:
    """Compact (physically) etcd's history up to its current revision."""

    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            etcd_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.load(response)
            return result

    revision = call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
    call("/v3/kv/compaction", {"revision": revision, "physical": True})


@pytest.fixture(scope="session")
async def postgres() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        yield db


@pytest.fixture(scope="session")
async def mysql() -> AsyncIterator[Database]:
    async with scratch_database("mysql") as db:
        yield db


@pytest.fixture(scope="session", params=["postgresql", "mysql"])
def database(request: pytest.FixtureRequest) -> Database:
    """Runs a test once on PostgreSQL and once on MariaDB."""
    fixture = "postgres" if request.param == "postgresql" else "mysql"
    db: Database = request.getfixturevalue(fixture)
    return db


@pytest.fixture
async def lapse_streams(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamContext]:
    """lapse's streams (default names) on the session's NATS server, for one test.

    They are deleted afterwards: their subjects are fixed, so two tests cannot hold them
    at once.
    """
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await streams.ensure_streams(js, streams.stream_configs(Streams()))
    yield js
    for name in Streams().model_dump().values():
        await js.delete_stream(name)
    await nc.close()
