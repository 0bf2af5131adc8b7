"""What every command does first: load the configuration, apply the global flags, and fall
back to what `lapse up` started when nothing is configured."""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lapse.cli import state
from lapse.cli.names import KNOWN_KINDS
from lapse.cli.parsing import did_you_mean, offer
from lapse.config.redact import redact_url
from lapse.embedded.nats_identities import READER, Identity, password_file
from lapse.errors import LapseError

# Only for types: a command's flags are defined and its --help printed without the
# configuration's schema, the Kubernetes client or NATS (docs/cli.md, "Start-up").
if TYPE_CHECKING:
    from lapse.config import LapseConfig
    from lapse.events.kinds import KindSet, KindSpec
    from lapse.runtime.resources import Resources

T = TypeVar("T")

# The kubeconfig lookup kubectl and the Kubernetes client make when nothing is given.
DEFAULT_KUBECONFIG = Path("~/.kube/config")

# How long a command waits for NATS to answer before it says so.
NATS_TIMEOUT = 10.0


class UsageError(LapseError):
    """The command line or the configuration is wrong: exit code 2."""


@dataclass(frozen=True)
class Settings:
    config: LapseConfig
    # Where each server's address came from, for `lapse status` and error messages.
    origins: dict[str, str] = field(default_factory=dict)


def state_dir_of(args: argparse.Namespace) -> Path:
    chosen: Path | None = getattr(args, "state_dir", None)
    return chosen if chosen is not None else state.default_state_dir()


def _with(config: LapseConfig, section: str, **values: Any) -> LapseConfig:
    part = getattr(config, section).model_copy(update=values)
    return config.model_copy(update={section: part})


def settings_from(
    args: argparse.Namespace,
    *,
    found_by_up: bool = True,
    identity: Identity = READER,
    ambient_cluster: bool = True,
) -> Settings:
    """The configuration with the global flags applied; with `found_by_up`, what `lapse up`
    wrote to its state directory fills in an unset NATS URL, database URL and cluster, and
    the NATS credential of `identity` (read-only unless the command repairs: `ADMIN`).

    Without `ambient_cluster` (commands that delete or schedule deletions), $KUBECONFIG and
    ~/.kube/config are not a choice of cluster: only flags, configuration, the pod, or the
    cluster `lapse up` started (lapse/cli/cluster.py)."""
    from lapse.config import ConfigError, load_config

    try:
        config = load_config(getattr(args, "config", None))
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    origins: dict[str, str] = {}
    kubeconfig: Path | None = getattr(args, "kubeconfig", None)
    if kubeconfig is not None:
        if not kubeconfig.is_file():
            raise UsageError(f"--kubeconfig {kubeconfig}: file not found")
        config = _with(config, "kubernetes", kubeconfig=kubeconfig, in_cluster=False)
    context: str | None = getattr(args, "context", None)
    if context is not None:
        config = _with(config, "kubernetes", context=context, in_cluster=False)
    nats_url: str | None = getattr(args, "nats_url", None)
    if nats_url:
        config = _with(config, "nats", url=nats_url)
        origins["nats"] = "--nats-url"
    elif config.nats.url:
        origins["nats"] = "nats.url"
    if config.database.url:
        origins["database"] = "database.url"
    if found_by_up:
        config = _found_by_up(config, state_dir_of(args), origins, identity, ambient_cluster)
    return Settings(config, origins)


def _found_by_up(
    config: LapseConfig,
    where: Path,
    origins: dict[str, str],
    identity: Identity,
    ambient_cluster: bool,
) -> LapseConfig:
    found = state.read(where, state.NATS_URL)
    if config.nats.url is None and found:
        config = _with(config, "nats", url=found[0])
        origins["nats"] = f"{found[1]} (written by lapse up)"
    # lapse up's server admits only its users: the command connects as the identity it
    # needs (also when --nats-url names that server), unless the configuration names a
    # credential of its own.
    secret = password_file(where, identity)
    if found and config.nats.url == found[0] and config.nats.auth_key is None and secret.exists():
        config = _with(config, "nats", user=identity.user, password_file=secret)
    if config.database.url is None and (found := state.read(where, state.DATABASE_URL)):
        config = _with(config, "database", url=found[0])
        origins["database"] = f"{found[1]} (written by lapse up)"
    found = state.read(where, state.KUBECONFIG)
    if found and not _cluster_configured(config):
        # A running `lapse up`'s cluster is the one a read-only command previews, even with
        # an ambient kubeconfig that kubectl would follow (lapse up never does): said.
        ambient = ambient_kubeconfig() if ambient_cluster else None
        if ambient is None or state.running_up(where) is not None:
            config = _with(config, "kubernetes", kubeconfig=Path(found[0]))
            origins["kubernetes"] = f"{found[1]} (written by lapse up)"
        if ambient is not None and "kubernetes" in origins:
            what = "$KUBECONFIG" if os.environ.get("KUBECONFIG") else "~/.kube/config"
            warn(
                f"asking the cluster `lapse up` started ({found[0]}), not {what} ({ambient}), "
                "which lapse up never uses; --kubeconfig or --context chooses another"
            )
    if not ambient_cluster and not _cluster_configured(config):
        if _in_a_pod():
            return _with(config, "kubernetes", in_cluster=True)
        ambient = os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise UsageError(
            "no cluster chosen: this command schedules deletions, so it uses only a cluster "
            "named with --kubeconfig/--context, kubernetes.kubeconfig "
            f"(LAPSE_KUBERNETES__KUBECONFIG) or the one `lapse up` started, never {ambient} "
            "by default"
        )
    return config


def _cluster_configured(config: LapseConfig) -> bool:
    """A cluster named by flag or configuration."""
    k = config.kubernetes
    return k.in_cluster or k.kubeconfig is not None or k.context is not None


def ambient_kubeconfig() -> str | None:
    """What kubectl reads with no flags: $KUBECONFIG, else ~/.kube/config if it exists."""
    if env := os.environ.get("KUBECONFIG"):
        return env
    default = DEFAULT_KUBECONFIG.expanduser()
    return str(default) if default.exists() else None


def _in_a_pod() -> bool:
    from lapse.edges.kubernetes.client import in_a_pod

    return in_a_pod()


def config_from(args: argparse.Namespace, *, identity: Identity = READER) -> LapseConfig:
    return settings_from(args, identity=identity).config


class Unreachable(LapseError):
    """A server did not answer: a runtime failure (exit 1)."""


async def reach_nats(resources: Resources, timeout: float = NATS_TIMEOUT) -> None:
    """Connect first, with a deadline: the shared connection retries forever (right for
    `lapse up`, wrong for a command someone is waiting on, e.g. after `lapse up` stopped)."""
    try:
        await asyncio.wait_for(resources.jetstream(), timeout)
    except (TimeoutError, OSError) as exc:
        url = redact_url(resources.config.nats.url)
        raise Unreachable(
            f"no answer from NATS at {url} within {timeout:g}s ({type(exc).__name__}): "
            "is the server (or `lapse up`) running? Set --nats-url or nats.url otherwise"
        ) from exc


def warn(message: str) -> None:
    print(f"lapse: warning: {message}", file=sys.stderr)


# --- kubectl habits ------------------------------------------------------------------------

GLOB_CHARS = "*?["


def add_namespace(parser: argparse.ArgumentParser, *, what: str = "runs") -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        help=f"only {what} in this namespace (exact, as in kubectl)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help=f"{what} in every namespace (what lapse does without -n)",
    )


def namespace_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(exact namespace, glob): `-n` is exact; a glob in `-n` still works as it did before
    0.2 but is deprecated in favour of `--namespace-glob`."""
    exact: str | None = None if args.all_namespaces else args.namespace
    pattern: str | None = getattr(args, "namespace_glob", None)
    if exact is not None and any(c in exact for c in GLOB_CHARS):
        warn(f"-n {exact!r}: a glob in -n is deprecated; use --namespace-glob {exact!r}")
        return None, exact
    if exact is not None and pattern is not None and not fnmatch.fnmatchcase(exact, pattern):
        raise UsageError(f"-n {exact} is outside --namespace-glob {pattern}")
    return exact, pattern


def add_namespace_glob(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace-glob",
        metavar="GLOB",
        help="only namespaces matching this shell glob (e.g. 'team-*'), filtered by lapse",
    )


def add_selector(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-l",
        "--selector",
        metavar="SELECTOR",
        help="label selector, passed to the API server (e.g. 'team=a,tier!=dev')",
    )


def add_kind(parser: argparse.ArgumentParser) -> None:
    kind = parser.add_argument(
        "--kind",
        action="append",
        metavar="KIND",
        help=(
            "only runs of this kind: a configured kind's name (argo-workflow, job, ...), "
            "its Kubernetes kind (Job, PipelineRun) or resource (jobs); repeatable"
        ),
    )
    offer(kind, KNOWN_KINDS)


def kinds_of(args: argparse.Namespace, kinds: KindSet) -> tuple[str, ...]:
    """The configured kind names `--kind` asks for (empty: every kind). Matches a kind by
    its name, its Kubernetes kind or its plural resource, case-insensitively."""
    wanted: list[str] = []
    for given in getattr(args, "kind", None) or ():
        text = given.strip().lower()
        found = [
            spec.name
            for spec in kinds
            if text
            in (spec.name, spec.kind.lower(), spec.resource, f"{spec.resource}.{spec.group}")
        ]
        if not found:
            raise UsageError(
                f"--kind {given!r} is not a configured kind (kinds: {', '.join(kinds.names())})"
                + did_you_mean(given, _kind_words(kinds))
            )
        wanted.extend(name for name in found if name not in wanted)
    return tuple(wanted)


def _kind_words(kinds: Iterable[KindSpec]) -> list[str]:
    return [word for spec in kinds for word in (spec.name, spec.kind, spec.resource)]


def kubernetes_kind(given: str, kinds: Iterable[KindSpec]) -> str:
    """The Kubernetes kind `--kind` names (`history`, `status`): a configured kind's name,
    kind or resource, case-insensitively; anything else is a usage error with the nearest
    one, not an empty answer."""
    text = given.strip().lower()
    for spec in kinds:
        if text in (spec.name, spec.kind.lower(), spec.resource):
            return spec.kind
    kinds = list(kinds)
    known = sorted({spec.kind for spec in kinds})
    raise UsageError(
        f"--kind {given!r} is not a kind lapse handles (one of {', '.join(known)})"
        + did_you_mean(given, _kind_words(kinds))
    )


def in_namespace(namespace: str, exact: str | None, pattern: str | None) -> bool:
    if exact is not None and namespace != exact:
        return False
    return pattern is None or fnmatch.fnmatchcase(namespace, pattern)


# A NATS server restarting or a stream leader being elected makes JetStream answer "no
# responders" for a few seconds; a read-only report waits that out instead of failing.
UNAVAILABLE_TRIES = 10


async def read_waiting_out_nats(read: Callable[[], Awaitable[T]]) -> T:
    """Run a read-only `read`, again (up to ~10 s) while NATS is briefly unavailable."""
    for attempt in range(1, UNAVAILABLE_TRIES + 1):
        try:
            return await read()
        except Exception as exc:
            from lapse.runtime.outages import nats_unavailable

            reason = nats_unavailable(exc)
            if reason is None or attempt == UNAVAILABLE_TRIES:
                raise
            print(f"lapse: {reason}; asking again", file=sys.stderr)
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")
