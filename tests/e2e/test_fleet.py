"""A fleet (issue 41, docs/fleet.md) on real servers: a hub nats-server and two clusters,
each its own `lapse up` whose NATS is a leaf node of the hub in its own JetStream domain,
as users run them (lapse.yaml's `fleet:`, `lapse fleet apply`, `lapse history --fleet`).

The two clusters share one kube-apiserver (the session's), each cleaning its own
namespace: what makes them two clusters here is what the fleet is about — two `lapse up`
processes, two NATS servers, two JetStream domains, two hub identities. A second and third
kube-apiserver would add ~20 s of start-up and prove nothing more about the fleet.

The partition is a real disconnect: each leaf reaches the hub through a relay the test cuts
(tests/tcp_cut.py), so both ends keep running and see their link drop.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from lapse.config import NatsConfig
from lapse.edges.fleet_streams import FLEET_AUDIT, fleet_subject
from lapse.edges.nats import security_options
from lapse.edges.streams import count_messages
from lapse.embedded.fleet_identities import (
    HUB_ADMIN,
    HUB_READER,
    hub_password_variables,
    hub_settings,
    hub_users,
    leaf_user,
)
from lapse.embedded.nats import EmbeddedNats, nats_server_binary
from lapse.embedded.nats_identities import ADMIN, READER, new_password, password_file
from lapse.embedded.process import free_port
from lapse.operations.audit import audit_events, fleet_audit_events, history_row
from tests.conftest import KubeStack
from tests.e2e.test_nats_auth_up import LAPSE, LapseUp, clean_env, workflow
from tests.stack import wait_for
from tests.tcp_cut import TcpCut

pytestmark = [pytest.mark.kube, pytest.mark.nats]

CLUSTERS = ("east", "west")
# A deadline met within this is on time: the watcher sees the finish, the schedule fires
# at the second, the reaper deletes (on 2 busy cores; lapse up's own figure is < 1 s).
ON_TIME_SECONDS = 5.0


@dataclass
class Cluster:
    name: str
    namespace: str
    up: LapseUp
    env: dict[str, str]
    state_dir: Path
    cut: TcpCut

    @property
    def nats_url(self) -> str:
        return (self.state_dir / "nats.url").read_text().strip()


@dataclass
class Fleet:
    hub: EmbeddedNats
    clusters: dict[str, Cluster]
    hub_env: dict[str, str]  # the CLI on the hub, as lapse-hub-reader
    passwords: dict[str, Path]

    def lapse(self, *args: str, env: dict[str, str] | None = None) -> Any:
        result = subprocess.run(
            [*LAPSE, *args], capture_output=True, text=True, env=env or self.hub_env, timeout=60
        )
        assert result.returncode == 0, (args, result.stderr)
        return json.loads(result.stdout) if "-o" in args else result.stdout


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, kube: KubeStack) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    passwords = {user: new_password() for user in hub_users(CLUSTERS)}
    files = {user: _write(base / f"{user}.password", pw + "\n") for user, pw in passwords.items()}
    leaf_port = free_port()
    settings = hub_settings(CLUSTERS, passwords, leaf_listen=f"127.0.0.1:{leaf_port}")
    # Each leaf reaches the hub through its relay only: a hub advertises its leaf port to
    # its leaves, which would reconnect there around a cut relay.
    settings["leafnodes"]["no_advertise"] = True
    hub = EmbeddedNats(base / "hub", settings=settings).start()
    clusters: dict[str, Cluster] = {}
    try:
        for name in CLUSTERS:
            home = base / name
            home.mkdir()
            namespace = kube.namespace(f"fleet-{name}-{uuid.uuid4().hex[:6]}")
            cut = TcpCut(leaf_port).heal()
            config = {
                "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
                "safety": {"namespaces": {"include": [namespace]}},
                "fleet": {
                    "cluster": name,
                    "leaf": {
                        "url": f"nats-leaf://127.0.0.1:{cut.port}",
                        "user": leaf_user(name),
                        "password_file": str(files[leaf_user(name)]),
                    },
                },
            }
            env = {
                **clean_env(home),
                "LAPSE_CONFIG": str(_write(home / "lapse.yaml", yaml.safe_dump(config))),
            }
            up = LapseUp(home, env)
            state_dir = home / "state" / "lapse"
            clusters[name] = Cluster(name, namespace, up, env, state_dir, cut)

            # One after the other: each embedded NATS takes port 4222 when it looks free,
            # so two starting at once could both try it.
            async def nats_up(up: LapseUp = up, url: Path = state_dir / "nats.url") -> bool:
                if up.process.poll() is not None:
                    raise AssertionError(up.log.read_text()[-3000:])
                return url.exists()  # noqa: ASYNC240 (a stat, polled)

            asyncio.run(wait_for(nats_up, timeout=60, interval=0.1))

        def hub_config(user: str) -> dict[str, Any]:
            hub_section = {"url": hub.url, "user": user, "password_file": str(files[user])}
            return {"fleet": {"hub": hub_section, "clusters": list(CLUSTERS)}}

        admin_yaml = _write(base / "hub-admin.yaml", yaml.safe_dump(hub_config(HUB_ADMIN.user)))
        reader_yaml = _write(base / "hub-reader.yaml", yaml.safe_dump(hub_config(HUB_READER.user)))
        hub_env = {**clean_env(base), "LAPSE_CONFIG": str(reader_yaml)}
        result = subprocess.run(
            [*LAPSE, "fleet", "apply"], capture_output=True, text=True, timeout=60,
            env={**hub_env, "LAPSE_CONFIG": str(admin_yaml)},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "created LAPSE_FLEET_AUDIT" in result.stdout, result.stdout

        async def all_running() -> bool:
            return all([await c.up.running() for c in clusters.values()])

        asyncio.run(wait_for(all_running, timeout=120, interval=0.3))
        yield Fleet(hub, clusters, hub_env, files)
    finally:
        # Every process stopped before any failure is reported: none outlives the test.
        failed = []
        for cluster in clusters.values():
            cluster.cut.cut()
            if cluster.up.stop() != 0:
                failed.append(cluster.up.log.read_text()[-3000:])
        hub.stop()
        assert not failed, failed


async def finish(kube: KubeStack, cluster: Cluster, names: list[str], ttl: str) -> None:
    for name in names:
        obj = workflow(name, "Succeeded", **{"lapse.dev/ttl": ttl})
        await kube.workflows.create(cluster.namespace, obj)


async def gone(kube: KubeStack, cluster: Cluster, names: list[str]) -> bool:
    items = (await kube.workflows.list(cluster.namespace))["items"]
    return not {w["metadata"]["name"] for w in items} & set(names)


def deleted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["target"] == "kubernetes" and r["outcome"] == "deleted"]


async def test_each_cluster_deletes_on_time_through_a_partition_and_the_hub_counts_each_once(
    fleet: Fleet, kube: KubeStack
) -> None:
    clusters = list(fleet.clusters.values())
    before = {c.name: [f"before-{i}" for i in range(3)] for c in clusters}
    for cluster in clusters:
        await finish(kube, cluster, before[cluster.name], "1s")
    for cluster in clusters:
        await wait_for(partial(gone, kube, cluster, before[cluster.name]), timeout=30, interval=0.2)

    def hub_rows(*args: str) -> list[dict[str, Any]]:
        return deleted(fleet.lapse("history", *args, "-o", "json")["items"])

    reader = fleet.passwords[HUB_READER.user]
    hub, _ = await _connect(fleet.hub.url, HUB_READER.user, reader)

    async def hub_deleted() -> list[tuple[str, str]]:
        """(cluster, uid) of every deletion on the hub, read as `history --fleet` does."""
        found = []
        async for cluster, event in fleet_audit_events(hub.jetstream()):
            row = history_row(event)
            if row and row["target"] == "kubernetes" and row["outcome"] == "deleted":
                found.append((cluster, str(row["uid"])))
        return found

    async def hub_has(count: int) -> bool:
        return len(await hub_deleted()) >= count

    async def local_deleted(cluster: Cluster) -> list[dict[str, Any]]:
        """The cluster's own deletions, from its own NATS (read as its `lapse history`)."""
        state = cluster.state_dir
        nc, _ = await _connect(cluster.nats_url, READER.user, password_file(state, READER))
        try:
            events = audit_events(nc.jetstream(), "LAPSE_AUDIT")
            rows = [row async for event in events if (row := history_row(event))]
        finally:
            await nc.close()
        return [r for r in deleted(rows) if r["namespace"] == cluster.namespace]

    async def local_has(cluster: Cluster, count: int) -> bool:
        return len(await local_deleted(cluster)) >= count

    await wait_for(lambda: hub_has(6), timeout=20, interval=0.2)

    # The partition: every leaf link to the hub is cut; both clusters keep deleting.
    for cluster in clusters:
        cluster.cut.cut()
    cut_at = time.monotonic()
    during = {c.name: [f"during-{i}" for i in range(3)] for c in clusters}
    for cluster in clusters:
        await finish(kube, cluster, during[cluster.name], "3s")
    for cluster in clusters:
        await wait_for(partial(gone, kube, cluster, during[cluster.name]), timeout=30, interval=0.2)
        # Its outcomes are recorded in its own domain (where its operator reads them)...
        await wait_for(partial(local_has, cluster, 6), timeout=10, interval=0.2)
    # ... and the hub cannot know: it still has the first three per cluster.
    assert len(await hub_deleted()) == 6

    for cluster in clusters:
        cluster.cut.heal()
    healed_at = time.monotonic()
    # After a cut, the hub asks each cluster's domain again with a growing back-off (its
    # source retries): seconds after a short cut, up to a minute after a long one.
    await wait_for(lambda: hub_has(12), timeout=45, interval=0.2)
    print(
        f"partition {healed_at - cut_at:.1f}s, hub complete "
        f"{time.monotonic() - healed_at:.1f}s after the heal"
    )
    for cluster in clusters:
        # Each cluster's own account: every deletion on time, those during the partition
        # included.
        local = await local_deleted(cluster)
        assert sorted(r["name"] for r in local) == sorted(
            before[cluster.name] + during[cluster.name]
        )
        late = [(r["name"], r["latencySeconds"]) for r in local]
        assert all(seconds < ON_TIME_SECONDS for _, seconds in late), late

    async def audit_counts() -> tuple[dict[str, int], dict[str, int]]:
        """Each cluster's audit stream as it holds it, and the hub's copy of it."""
        own, copied = {}, {}
        for cluster in clusters:
            state = cluster.state_dir
            nc, _ = await _connect(cluster.nats_url, READER.user, password_file(state, READER))
            try:
                own[cluster.name] = (await nc.jetstream().stream_info("LAPSE_AUDIT")).state.messages
            finally:
                await nc.close()
            subject = f"{fleet_subject(cluster.name, 'audit')}.>"
            copied[cluster.name] = await count_messages(hub.jetstream(), FLEET_AUDIT, subject)
        return own, copied

    async def copies_complete() -> bool:
        own, copied = await audit_counts()
        return own == copied

    # Every audit event once on the hub, the schedules and skips included.
    await wait_for(copies_complete, timeout=10, interval=0.2)
    counts, _ = await audit_counts()
    await hub.close()
    report = fleet.lapse("status", "--fleet", "-o", "json")["clusters"]
    assert [(c["cluster"], c["auditEvents"], c["error"]) for c in report] == [
        (name, counts[name], None) for name in sorted(counts)
    ]
    assert all(c["lastHeardSeconds"] is not None for c in report), report
    rows = hub_rows("--fleet")
    # Every outcome once, under the cluster that deleted it (and no other cluster's rows).
    assert len(rows) == 12, rows
    assert len({(r["cluster"], r["uid"]) for r in rows}) == 12
    for cluster in clusters:
        own = [r for r in rows if r["cluster"] == cluster.name]
        assert {r["namespace"] for r in own} == {cluster.namespace}
        assert sorted(r["name"] for r in own) == sorted(before[cluster.name] + during[cluster.name])
    assert hub_rows("--cluster", "east") == [r for r in rows if r["cluster"] == "east"]
    # The table names the cluster in every row.
    west = fleet.clusters["west"].namespace
    table = fleet.lapse(
        "history", "--cluster", "west", "-n", west, "--outcome", "deleted", "--no-headers"
    ).splitlines()
    assert len(table) == 6 and all(line.split()[:3:2] == ["west", west] for line in table), table


async def _connect(url: str, user: str, password: Path) -> tuple[NATS, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    config = NatsConfig(url=url, user=user, password_file=password)
    nc = NATS()
    await nc.connect(url, error_cb=on_error, max_reconnect_attempts=0, **security_options(config))
    return nc, errors


async def refused(nc: NATS, subject: str) -> None:
    """A request nobody answers: the permission kept it from anyone who could."""
    with pytest.raises((NoRespondersError, NatsTimeout)):
        await nc.request(subject, b"{}", timeout=1)


async def test_a_clusters_credentials_reach_neither_another_cluster_nor_the_hub(
    fleet: Fleet,
) -> None:
    east, west = fleet.clusters["east"], fleet.clusters["west"]
    # East's leaf identity, used as a client of the hub by whoever stole it from east.
    nc, errors = await _connect(
        fleet.hub.url, leaf_user("east"), fleet.passwords[leaf_user("east")]
    )
    try:
        for subject, reported in (
            # West's domain.
            ("$JS.west.API.STREAM.INFO.LAPSE_AUDIT", None),
            # The hub's streams (the server names its own domain's API without it).
            ("$JS.hub.API.STREAM.INFO.LAPSE_FLEET_AUDIT", "$JS.API.STREAM.INFO.LAPSE_FLEET_AUDIT"),
            ("$JS.API.DIRECT.GET.LAPSE_FLEET_AUDIT", None),
            # West's deliveries to the hub.
            ("lapse.fleet.west.deliver.audit", None),
        ):
            await nc.publish(subject, b"{}")
            said = f'violation for publish to "{(reported or subject).lower()}"'
            await wait_for(partial(_told, errors, said), timeout=5)
        await nc.subscribe("lapse.fleet.west.>")
        await wait_for(lambda: _told(errors, 'subscription to "lapse.fleet.west.>"'), timeout=5)
    finally:
        await nc.close()

    # East's own NATS, in an attacker's hands (its admin identity may publish anything
    # there): the hub forwards none of it to west's domain nor to the hub's API.
    state = east.state_dir
    nc, _ = await _connect(east.nats_url, ADMIN.user, password_file(state, ADMIN))
    try:
        assert (await nc.request("$JS.API.STREAM.INFO.LAPSE_AUDIT", b"", timeout=5)).data
        await refused(nc, "$JS.west.API.STREAM.INFO.LAPSE_AUDIT")
        await refused(nc, "$JS.hub.API.STREAM.INFO.LAPSE_FLEET_AUDIT")
    finally:
        await nc.close()

    # And the other way: the hub (its admin) may source a cluster's streams, never change
    # one; west's schedules are still there.
    admin = fleet.passwords[HUB_ADMIN.user]
    nc, _ = await _connect(fleet.hub.url, HUB_ADMIN.user, admin)
    try:
        await refused(nc, "$JS.west.API.STREAM.DELETE.LAPSE_SCHED")
        await refused(nc, "$JS.west.API.STREAM.PURGE.LAPSE_AUDIT")
    finally:
        await nc.close()
    nc, _ = await _connect(west.nats_url, ADMIN.user, password_file(west.state_dir, ADMIN))
    try:
        info = json.loads((await nc.request("$JS.API.STREAM.INFO.LAPSE_SCHED", b"", 5)).data)
        assert "error" not in info, info
    finally:
        await nc.close()


async def _told(errors: list[str], said: str) -> bool:
    return any(said in e for e in errors)


def test_the_hubs_printed_configuration_is_one_nats_server_accepts(tmp_path: Path) -> None:
    config = _write(tmp_path / "lapse.yaml", yaml.safe_dump({"fleet": {"clusters": ["a", "b"]}}))
    env = {**clean_env(tmp_path), "LAPSE_CONFIG": str(config)}
    printed = subprocess.run(
        [*LAPSE, "fleet", "conf", "--store-dir", str(tmp_path / "js")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    conf = _write(tmp_path / "hub.conf", printed.stdout)
    passwords = {
        variable: new_password() for variable in hub_password_variables(("a", "b")).values()
    }
    assert all(f"${variable}" in printed.stdout for variable in passwords)
    assert not any(password in printed.stdout for password in passwords.values())
    checked = subprocess.run(
        [nats_server_binary(), "-c", str(conf), "-t"],
        capture_output=True, text=True, env={**env, **passwords}, timeout=30,
    )  # fmt: skip
    assert checked.returncode == 0 and "is valid" in checked.stderr + checked.stdout, checked


def test_lapse_up_refuses_a_leaf_for_a_nats_it_did_not_start(tmp_path: Path) -> None:
    config = {
        "nats": {"url": "nats://127.0.0.1:4222"},
        "fleet": {
            "cluster": "east",
            "leaf": {"url": "nats-leaf://hub:7422", "user": "u", "password_file": "/p"},
        },
    }
    env = {
        **clean_env(tmp_path),
        "LAPSE_CONFIG": str(_write(tmp_path / "lapse.yaml", yaml.safe_dump(config))),
    }
    result = subprocess.run(
        [*LAPSE, "up", "--listen", ""], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "fleet.leaf:" in result.stderr and "configure that server" in result.stderr
