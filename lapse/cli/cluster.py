"""Which cluster a command talks to, and how much `lapse up` may delete there.

A first `lapse up` must never touch a real cluster by surprise (docs/architecture.md,
"Choosing the cluster"):

- `lapse up` and `lapse reconcile` (they delete, or schedule deletions) use only a cluster
  chosen explicitly: `--kubeconfig`/`--context`, `kubernetes.kubeconfig`/`context`/
  `in_cluster` (file or `LAPSE_KUBERNETES__*`), or the pod they run in. An ambient
  `$KUBECONFIG` or `~/.kube/config` is not a choice: `lapse up` starts its embedded
  kube-apiserver instead, `lapse reconcile` uses the one `lapse up` started.
- The read-only commands (`plan`, `status`, `history`, ...) ask the cluster a running
  `lapse up` started, so `lapse plan` previews what `lapse up` deletes; with an ambient
  `$KUBECONFIG` or `~/.kube/config` they say on stderr, in one line, which cluster they ask
  and why. With no `lapse up` running they follow the ambient kubeconfig as kubectl does:
  reading cannot harm.
- On a real cluster, `lapse up` deletes only in the namespaces `safety.namespaces.include`
  names (`["*"]` for every one); with none named it runs in dry-run and says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lapse.cli.common import UsageError, ambient_kubeconfig
from lapse.config import LapseConfig


def in_a_pod() -> bool:
    """The kubelet's in-cluster signal: the API server's address in the environment and a
    ServiceAccount token mounted (as client-go and kubectl read it)."""
    from lapse.edges.kubernetes.client import in_a_pod as pod

    return pod()


def chosen_explicitly(config: LapseConfig) -> bool:
    """A cluster named by flag or configuration (the global flags are applied to `config`
    already), not one found lying around."""
    k = config.kubernetes
    return k.in_cluster or k.kubeconfig is not None or k.context is not None


def check_kubeconfig_files(config: LapseConfig) -> None:
    """A kubeconfig that does not exist is a usage error naming the path and where it came
    from, not the client's "Invalid kube-config file. No configuration found."."""
    k = config.kubernetes
    if k.kubeconfig is not None:
        if not k.kubeconfig.expanduser().is_file():
            raise UsageError(f"kubernetes.kubeconfig {k.kubeconfig}: file not found")
        return
    if k.in_cluster:
        return
    env = os.environ.get("KUBECONFIG")
    if env:
        paths = [p for p in env.split(os.pathsep) if p]
        if paths and not any(Path(p).expanduser().is_file() for p in paths):
            raise UsageError(f"$KUBECONFIG {env}: file not found")


@dataclass(frozen=True)
class ClusterView:
    """What the start-up line says about the cluster."""

    server: str
    context: str

    @classmethod
    def of(cls, config: LapseConfig) -> ClusterView:
        from kubernetes import config as kube_config

        from lapse.edges.kubernetes.client import load_api_client

        k = config.kubernetes
        kubeconfig = str(k.kubeconfig) if k.kubeconfig else None
        api = load_api_client(kubeconfig, k.context, k.in_cluster)
        try:
            server = str(api.configuration.host)
        finally:
            api.close()
        if k.in_cluster or (kubeconfig is None and ambient_kubeconfig() is None):
            return cls(server, "in-cluster ServiceAccount")
        context = k.context
        if context is None:
            _, active = kube_config.list_kube_config_contexts(config_file=kubeconfig)
            context = str(active.get("name", "?")) if active else "?"
        return cls(server, context)


def namespaces_named(config: LapseConfig) -> bool:
    """Whether the operator named the namespaces lapse deletes in (`["*"]` counts): the
    built-in default of every namespace does not."""
    return "include" in config.safety.namespaces.model_fields_set


def scoped_for_real_cluster(config: LapseConfig) -> tuple[LapseConfig, bool]:
    """On a real cluster without `safety.namespaces.include`: dry-run (True when forced)."""
    if namespaces_named(config) or config.safety.dry_run:
        return config, False
    safety = config.safety.model_copy(update={"dry_run": True})
    return config.model_copy(update={"safety": safety}), True


def scope_text(config: LapseConfig) -> str:
    namespaces = config.safety.namespaces
    text = ",".join(namespaces.include)
    if namespaces.exclude:
        text += f" except {','.join(namespaces.exclude)}"
    return text


def startup_line(
    config: LapseConfig, view: ClusterView, *, embedded: bool, forced_dry_run: bool
) -> str:
    """The one line that says where `lapse up` deletes what, before it deletes anything."""
    where = "the embedded kube-apiserver" if embedded else "a real cluster"
    kinds = ",".join(config.kinds.names())
    line = (
        f"cluster {view.server} (context {view.context}, {where}); "
        f"namespaces {scope_text(config)}; kinds {kinds}; "
    )
    if forced_dry_run:
        return line + (
            "DRY-RUN: nothing is deleted on a real cluster until safety.namespaces.include "
            'names the namespaces (["*"] for every one)'
        )
    if config.safety.dry_run:
        return line + "DRY-RUN (safety.dry_run): nothing is deleted"
    return line + "deleting (not dry-run)"
