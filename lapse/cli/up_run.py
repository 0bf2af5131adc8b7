"""`lapse up`'s work: embedded servers for whatever is not configured, then the whole
pipeline (lapse/cli/up.py defines the flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kubernetes import client

from lapse.cli import cluster, state
from lapse.cli.common import ambient_kubeconfig, settings_from, state_dir_of
from lapse.config import ConfigError, LapseConfig
from lapse.config.schema import NATS_AUTH_KEYS, ArtifactsSection, FleetConfig, FleetLeaf
from lapse.edges.kubernetes import load_api_client
from lapse.embedded.fleet_identities import LeafLink, leaf_settings
from lapse.embedded.kube import EmbeddedKube, policy_crds, run_kind_crds
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.nats_identities import (
    EMBEDDED,
    PROCESS,
    authorization,
    ensure_passwords,
    password_file,
)
from lapse.embedded.process import ServerStartError, free_port, port_open
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS, weed_binary
from lapse.functions.artifact_reaper.stores import ArtifactStore
from lapse.runtime import shutdown
from lapse.runtime.consumers import owned_durables, retired_durables
from lapse.runtime.ingress import listen_token
from lapse.runtime.pipeline import Pipeline

log = logging.getLogger("lapse")

DEFAULT_NATS_PORT = 4222


def has_cluster(config: LapseConfig) -> bool:
    """A cluster chosen explicitly (flag, configuration) or the pod lapse runs in; then no
    embedded kube-apiserver is started. An ambient $KUBECONFIG or ~/.kube/config is not a
    choice: a first `lapse up` never deletes in whatever cluster kubectl points at."""
    return cluster.chosen_explicitly(config) or cluster.in_a_pod()


def start_embedded_nats(state_dir: Path, fleet: FleetConfig | None = None) -> EmbeddedNats:
    """The embedded server admits only lapse's identities (nats_identities: the process,
    the read-only commands, the admin), each with the subjects it may publish and the
    durable consumers it owns; their
    passwords stay in the state directory, where the other commands find them. With
    `fleet.leaf`, it is a leaf node of the fleet's hub in its own JetStream domain
    (docs/fleet.md)."""
    port = DEFAULT_NATS_PORT if not port_open(DEFAULT_NATS_PORT) else free_port()
    settings = authorization(
        ensure_passwords(state_dir), EMBEDDED, owned_durables(), retired_durables()
    )
    if fleet is not None and fleet.leaf is not None and fleet.cluster is not None:
        durables = tuple(sorted({d for owned in owned_durables().values() for d in owned}))
        settings |= leaf_settings(_leaf_link(fleet.cluster, fleet.leaf), durables)
    server = EmbeddedNats(state_dir / "nats", port=port, settings=settings).start()
    state.write(state_dir, state.NATS_URL, server.url)
    return server


def _leaf_link(cluster: str, leaf: FleetLeaf) -> LeafLink:
    try:
        password = leaf.password_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            [f"fleet.leaf.password_file: cannot read {leaf.password_file} ({exc.strerror})"]
        ) from None
    if not password:
        raise ConfigError([f"fleet.leaf.password_file: {leaf.password_file} is empty"])
    return LeafLink(
        cluster=cluster,
        urls=tuple(url.strip() for url in leaf.url.split(",")),
        user=leaf.user,
        password=password,
        ca_file=str(leaf.ca_file) if leaf.ca_file is not None else None,
    )


def as_process(config: LapseConfig, state_dir: Path) -> LapseConfig:
    """`config` connecting to the embedded server as the process identity."""
    # Whatever credential the configuration names is for a server of its own, not this.
    unset = {key: None for keys in NATS_AUTH_KEYS.values() for key in keys}
    nats = config.nats.model_copy(
        update={**unset, "user": PROCESS.user, "password_file": password_file(state_dir, PROCESS)}
    )
    return config.model_copy(update={"nats": nats})


# The embedded S3 server's one bucket and the store lapse configures for it.
EMBEDDED_BUCKET = "lapse-artifacts"
EMBEDDED_STORE = "embedded"
# Credentials of another S3 account in the shell would be mixed with the embedded
# server's keys (a session token signs every request): not used while it runs.
_FOREIGN_AWS = ("AWS_SESSION_TOKEN", "AWS_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")


def start_embedded_s3(state_dir: Path) -> EmbeddedSeaweedFS | None:
    """An S3 server (SeaweedFS) in the state directory, for the artifacts target on the
    embedded cluster; None, said in one line, when its binary is not built: `lapse up`
    runs on without the artifacts target rather than failing for an optional part."""
    try:
        weed_binary()
    except ServerStartError:
        log.warning(
            "no S3 server: SeaweedFS is not built (`make seaweedfs` builds it once); running "
            "without the artifacts target"
        )
        return None
    # The keys an earlier `lapse up` made are used again: its objects are there.
    server = EmbeddedSeaweedFS.in_state(state_dir / "seaweedfs", buckets=(EMBEDDED_BUCKET,))
    try:
        server.start()
    except ServerStartError as exc:
        server.stop()
        log.warning(
            "no S3 server: SeaweedFS did not start (%s; its log: %s); running without the "
            "artifacts target",
            str(exc).splitlines()[0],
            server.log_path,
        )
        return None
    # Where S3 clients find credentials (obstore reads them there): never lapse.yaml.
    for name in _FOREIGN_AWS:
        os.environ.pop(name, None)
    os.environ.update(server.env())
    return server


def embedded_store(server: EmbeddedSeaweedFS, artifacts: ArtifactsSection) -> ArtifactsSection:
    """One store over the embedded bucket: what a run records there (an Argo Workflow's
    output artifacts and archived logs, KFP's through its Workflow) is deleted on the
    artifacts clock. The rest of `artifacts` (the client's timeouts) is kept."""
    store = ArtifactStore(
        name=EMBEDDED_STORE,
        url=f"s3://{EMBEDDED_BUCKET}/",
        endpoint=server.endpoint,
        region=REGION,
    )
    return artifacts.model_copy(update={"stores": (store,)})


# How long the embedded API server may take to serve the CRDs it was just given.
CRD_SERVED_TIMEOUT = 60.0


def start_embedded_kube(state_dir: Path) -> EmbeddedKube:
    kube = EmbeddedKube(state_dir / "kube").start()
    api_client = load_api_client(str(kube.kubeconfig_path))
    api = client.ApiextensionsV1Api(api_client)
    crds = [*run_kind_crds(), *policy_crds()]
    for crd in crds:
        try:
            api.create_custom_resource_definition(crd)
        except client.exceptions.ApiException as exc:
            if exc.status != 409:  # kept from an earlier run in the same state dir
                raise
    # Until a new CRD is served, a LIST answers 404 (or 429 while its storage initialises):
    # the watchers would warn "CRD is not installed?" on every `make run` and look again
    # only a minute later.
    objects = client.CustomObjectsApi(api_client)
    deadline = time.monotonic() + CRD_SERVED_TIMEOUT
    for crd in crds:
        spec: Any = crd["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("served", True))
        while True:
            try:
                objects.list_cluster_custom_object(
                    spec["group"], version, spec["names"]["plural"], limit=1
                )
                break
            except client.exceptions.ApiException as exc:
                if exc.status not in (404, 429) or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
    api_client.close()
    return kube


def run_up(args: argparse.Namespace) -> int:
    # What an earlier `lapse up` wrote is not configuration: this one starts its own.
    config = settings_from(args, found_by_up=False).config
    # Before any server is started: an ingress open beyond loopback is a configuration
    # error (exit 2, the key named), not something to find out after the cluster came up.
    listen_token(args.listen or None, config.ingress)
    if has_cluster(config):  # before any server starts: a missing file is a usage error
        cluster.check_kubeconfig_files(config)
    if config.fleet.leaf is not None and config.nats.url is not None:
        raise ConfigError(
            [
                "fleet.leaf: it makes lapse up's own NATS a leaf node of the hub; with "
                "nats.url set, configure that server as the leaf instead (docs/fleet.md)"
            ]
        )
    state_dir = state_dir_of(args)
    state.make_private(state_dir)  # credentials are written there: 0600 in 0700
    state.write(state_dir, state.UP, f"{version('lapse')} {os.getpid()}")
    nats_server: EmbeddedNats | None = None
    kube: EmbeddedKube | None = None
    s3: EmbeddedSeaweedFS | None = None
    try:
        if config.nats.url is None:
            nats_server = start_embedded_nats(state_dir, config.fleet)
            config = as_process(config, state_dir)
            log.info(
                "no nats.url configured: started nats-server at %s (users and passwords in %s)",
                nats_server.url,
                password_file(state_dir, PROCESS).parent,
            )
            if config.fleet.leaf is not None:
                log.info(
                    "fleet: this cluster's JetStream domain is %r, a leaf node of the hub "
                    "at %s as %s (its deadlines stay here; docs/fleet.md)",
                    config.fleet.cluster,
                    config.fleet.leaf.url,
                    config.fleet.leaf.user,
                )
        if config.database.url is None:
            url = f"sqlite:///{state_dir / 'lapse.db'}"
            config = config.model_copy(
                update={"database": config.database.model_copy(update={"url": url})}
            )
            state.write(state_dir, state.DATABASE_URL, url)
            log.info("no database.url configured: using %s", url)
        if not has_cluster(config):
            ambient = ambient_kubeconfig()
            log.info(
                "no cluster chosen: starting a local kube-apiserver%s (see lapse up --help)",
                f" ({ambient} is not used without --kubeconfig)" if ambient else "",
            )
            kube = start_embedded_kube(state_dir)
            config = config.model_copy(
                update={
                    "kubernetes": config.kubernetes.model_copy(
                        update={"kubeconfig": kube.kubeconfig_path}
                    )
                }
            )
            state.write(state_dir, state.KUBECONFIG, str(kube.kubeconfig_path))
            log.info("local cluster at %s, kubeconfig %s", kube.url, kube.kubeconfig_path)
            # Only beside the embedded cluster: on a real one, artifacts live in the
            # user's own stores (artifacts.stores), never in a server lapse made up.
            if not config.artifacts.stores:
                s3 = start_embedded_s3(state_dir)
            if s3 is not None:
                artifacts = embedded_store(s3, config.artifacts)
                config = config.model_copy(update={"artifacts": artifacts})
                log.info(
                    "no artifacts.stores configured: started an S3 server (SeaweedFS) at %s, "
                    "bucket %s, store %r (its keys in %s, 0600)",
                    s3.endpoint,
                    EMBEDDED_BUCKET,
                    EMBEDDED_STORE,
                    s3.identities_path,
                )
        config = _announce_scope(config, embedded=kube is not None)
        config = _with_watch_lease(config, shared_nats=nats_server is None)
        nats_url = nats_server.url if nats_server else config.nats.url
        asyncio.run(
            _serve(
                Pipeline(
                    config,
                    nats_url=nats_url,
                    listen=args.listen or None,
                    metrics_host=args.metrics_host,
                    watch=args.watch,
                )
            )
        )
    finally:
        state.remove(state_dir, state.UP)
        if s3 is not None:
            s3.stop()
        if kube is not None:
            state.remove(state_dir, state.KUBECONFIG)
            kube.stop()
        if nats_server is not None:
            state.remove(state_dir, state.NATS_URL)
            nats_server.stop()
    return 0


def _with_watch_lease(config: LapseConfig, *, shared_nats: bool) -> LapseConfig:
    """`kubernetes.watch_lease.enabled` unset: on when other processes may share the NATS
    (one lapse up did not start itself), off with the embedded one."""
    lease = config.kubernetes.watch_lease
    if lease.enabled is not None:
        return config
    kube = config.kubernetes.model_copy(
        update={"watch_lease": lease.model_copy(update={"enabled": shared_nats})}
    )
    return config.model_copy(update={"kubernetes": kube})


def _announce_scope(config: LapseConfig, *, embedded: bool) -> LapseConfig:
    """Say in one line where lapse deletes what; on a real cluster with no namespaces
    named, run in dry-run (lapse/cli/cluster.py says why)."""
    if not cluster.chosen_explicitly(config):  # the pod's own cluster
        kube = config.kubernetes.model_copy(update={"in_cluster": True})
        config = config.model_copy(update={"kubernetes": kube})
    forced = False
    if not embedded:
        config, forced = cluster.scoped_for_real_cluster(config)
    line = cluster.startup_line(
        config, cluster.ClusterView.of(config), embedded=embedded, forced_dry_run=forced
    )
    log.log(logging.WARNING if config.safety.dry_run else logging.INFO, "%s", line)
    return config


async def _serve(pipeline: Pipeline) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await pipeline.run(stop)
    finally:
        shutdown.guard(loop)  # asyncio.run then waits for what is left
