"""The shape of `lapse.yaml`: one pydantic model per section, every key with its default.

`lapse.example.yaml` documents every key; docs/architecture.md lists the sections. The
`safety` section is the handlers' own type (`lapse.functions.safety`), composed here.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    model_validator,
)

from lapse.config.database_syntax import DatabaseURLError, drivername, parses
from lapse.events.kinds import DEFAULT_KIND_NAMES, KindSet, KindSpec, resolve_kinds
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.durations import DurationField, PositiveDuration
from lapse.functions.policy import Policies
from lapse.functions.row_reaper.targets import KFP_SINGLE_USER_NAMESPACE
from lapse.functions.safety import SafetyConfig


def _checked(pattern: str, what: str) -> AfterValidator:
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


StreamName = Annotated[
    str, _checked(r"[A-Za-z0-9_-]{1,32}", "a stream name (1-32 letters, digits, '-' or '_')")
]
# Syntax only: the reaper checks the names against the reflected schema at start-up.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
TableName = Annotated[
    str, _checked(rf"{_IDENT}(\.{_IDENT})?", "an SQL table name ([schema.]table, letters/digits/_)")
]
ColumnName = Annotated[str, _checked(_IDENT, "an SQL column name (letters, digits and _)")]
TargetName = Annotated[
    str, _checked(r"[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?", "a name (lower case, digits, - and _)")
]
KeyFrom = Annotated[
    str,
    _checked(
        r"uid|name|(label|annotation):[^\s:][^\s]*",
        "a key source (uid, name, label:<key> or annotation:<key>)",
    ),
]


def _database_url(value: str) -> str:
    # Messages never echo the URL: it usually carries a password.
    # SQLAlchemy's grammar, without SQLAlchemy: only the row-reaper's image carries it.
    if not parses(value):
        raise ValueError("not a SQLAlchemy URL (e.g. postgresql://user:password@host/db)")
    try:
        drivername(value)
    except DatabaseURLError as exc:
        raise ValueError(str(exc)) from None
    return value


def _servers(value: str, schemes: tuple[str, ...], what: str) -> list[str]:
    """What follows each scheme in `value` (comma-separated URLs, each with one of
    `schemes`); `what` opens the message, its parenthesis closed here."""
    rests = []
    for server in value.split(","):
        scheme, sep, rest = server.strip().partition("://")
        if not sep or scheme not in schemes or not rest:
            raise ValueError(f"not {what} several separated by commas)")
        rests.append(rest)
    return rests


def _nats_url(value: str) -> str:
    _servers(
        value,
        ("nats", "tls", "ws", "wss"),
        "a NATS URL (nats://host:4222, tls://, ws:// or wss://;",
    )
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Streams(_Section):
    schedule: StreamName = "LAPSE_SCHED"
    events: StreamName = "LAPSE_EVENTS"
    audit: StreamName = "LAPSE_AUDIT"
    dlq: StreamName = "LAPSE_DLQ"

    @model_validator(mode="after")
    def _distinct(self) -> Streams:
        names = [self.schedule, self.events, self.audit, self.dlq]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must differ: {', '.join(names)}")
        return self


class StreamPlacement(_Section):
    """Which NATS servers hold the streams' replicas (JetStream placement): a cluster by
    name, and server tags every chosen server must have. Unset: the server decides."""

    cluster: str | None = Field(default=None, min_length=1)
    tags: tuple[Annotated[str, Field(min_length=1)], ...] = ()


def _secret_text(value: object) -> object:
    # A secret is never echoed, not even in an error: YAML turns an unquoted 12345 or yes
    # into a number or a boolean, and the generic messages show the value they got.
    if isinstance(value, str | SecretStr):
        return value
    raise ValueError("must be text: quote it in YAML (the value is not shown)")


# Shown as '**********' by repr and str; the text only through get_secret_value().
Secret = Annotated[SecretStr, BeforeValidator(_secret_text)]


class NatsTls(_Section):
    """TLS to the NATS server (tls:// URLs, or a server that requires it)."""

    # PEM bundle of the CA that signed the server's certificate (default: the system's).
    ca_file: Path | None = None
    # A client certificate and its key (PEM), for a server that verifies clients.
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _pair(self) -> NatsTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "cert_file and key_file go together (a client certificate and its key)"
            )
        return self


# The ways to authenticate, each with the keys that configure it (at most one way).
NATS_AUTH_KEYS = {
    "user/password": ("user", "password", "password_file"),
    "token": ("token", "token_file"),
    "nkey": ("nkey_file",),
    "creds": ("creds_file",),
}


class NatsConfig(_Section):
    # Absent: `lapse up` / `lapse demo` start an embedded nats-server.
    url: Annotated[str, AfterValidator(_nats_url)] | None = Field(default=None, repr=False)
    streams: Streams = Streams()
    # Copies of each stream (RAFT) in a JetStream cluster: 3 survives losing one server.
    replicas: int = Field(default=1, ge=1, le=5)
    placement: StreamPlacement = StreamPlacement()
    audit_max_age: PositiveDuration = timedelta(days=30)
    max_deliver: int = Field(default=5, ge=1)
    # Short: it only decides how soon a dead process's work is delivered again; live work is
    # marked in progress by the dispatcher's heartbeats.
    ack_wait: PositiveDuration = timedelta(seconds=4)
    # Authentication: one way at most. Secrets come from a file (`*_file`, read when
    # connecting) or from the environment (LAPSE_NATS__PASSWORD, LAPSE_NATS__TOKEN); they
    # are never logged and never shown by repr.
    user: str | None = Field(default=None, min_length=1)
    password: Secret | None = Field(default=None, repr=False)
    password_file: Path | None = None
    token: Secret | None = Field(default=None, repr=False)
    token_file: Path | None = None
    nkey_file: Path | None = None  # an nkey seed (SU...), as `nk -gen user` writes it
    creds_file: Path | None = None  # a .creds file: user JWT and nkey seed
    tls: NatsTls = NatsTls()

    @model_validator(mode="after")
    def _one_way_to_authenticate(self) -> NatsConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("password and password_file: set one")
        if self.token is not None and self.token_file is not None:
            raise ValueError("token and token_file: set one")
        has_password = self.password is not None or self.password_file is not None
        if (self.user is None) != (not has_password):
            raise ValueError("user and password (or password_file) go together")
        used = [way for way, keys in NATS_AUTH_KEYS.items() if self._set(keys)]
        if len(used) > 1:
            raise ValueError(f"one way to authenticate, not {' and '.join(used)}")
        return self

    def _set(self, keys: tuple[str, ...]) -> bool:
        return any(getattr(self, key) is not None for key in keys)

    @property
    def auth_key(self) -> str | None:
        """The key a refused credential is reported under (nats.password_file, ...)."""
        for keys in NATS_AUTH_KEYS.values():
            for key in reversed(keys):
                if getattr(self, key) is not None:
                    return f"nats.{key}"
        return None


# A cluster's name in the fleet: its JetStream domain and a token of the hub's subjects
# (lapse.fleet.<cluster>.>), so no dots, wildcards or spaces (docs/fleet.md).
ClusterName = Annotated[
    str,
    _checked(
        r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?",
        "a cluster name (1-32 lower-case letters, digits and '-', a letter or digit at each end)",
    ),
]


def _leaf_url(value: str) -> str:
    rests = _servers(
        value,
        ("nats-leaf", "tls", "ws", "wss"),
        "a leaf node URL (nats-leaf://hub:7422, tls://, ws:// or wss://;",
    )
    if any("@" in rest for rest in rests):
        # Credentials come from user and password_file, never from the URL: it is logged,
        # and shown by `lapse up`'s configuration errors.
        raise ValueError("no credentials in the URL: set user and password_file")
    return value


class FleetLeaf(_Section):
    """How `lapse up`'s embedded NATS joins the fleet's hub as a leaf node: the hub's leaf
    node port and this cluster's own hub identity (`lapse-leaf-<cluster>`, docs/fleet.md)."""

    url: Annotated[str, AfterValidator(_leaf_url)] = Field(repr=False)
    user: str = Field(min_length=1)
    # Read by `lapse up` when it writes its NATS's configuration (0600 in its state dir).
    password_file: Path
    # The CA that signed the hub's certificate (tls:// URLs); default: the system's.
    ca_file: Path | None = None


class FleetHub(_Section):
    """Where `--fleet` commands and `lapse fleet apply` reach the hub: its client port and
    an identity of the hub's (docs/fleet.md: lapse-hub-reader reads, lapse-hub-admin
    applies the streams). Secrets only from files."""

    url: Annotated[str, AfterValidator(_nats_url)] = Field(repr=False)
    user: str | None = Field(default=None, min_length=1)
    password_file: Path | None = None
    creds_file: Path | None = None
    tls: NatsTls = NatsTls()

    def as_nats(self) -> NatsConfig:
        """The `nats:` section that connects to the hub (its checks of the credentials
        included)."""
        return NatsConfig(
            url=self.url,
            user=self.user,
            password_file=self.password_file,
            creds_file=self.creds_file,
            tls=self.tls,
        )

    @model_validator(mode="after")
    def _credentials(self) -> FleetHub:
        self.as_nats()
        return self


class FleetConfig(_Section):
    """A fleet of clusters (docs/fleet.md): each keeps its deadlines in its own JetStream
    domain, a leaf node of the hub, which sources every cluster's outcomes and lifecycle
    events into its own streams."""

    # This cluster's name: `lapse up`'s JetStream domain and its name on the hub.
    cluster: ClusterName | None = None
    # `lapse up`: its embedded NATS is a leaf node of the hub (needs `cluster`).
    leaf: FleetLeaf | None = None
    # The hub's client port, for `--fleet` commands and `lapse fleet apply`.
    hub: FleetHub | None = None
    # On the hub: the clusters whose events its streams source (`lapse fleet apply`).
    clusters: tuple[ClusterName, ...] = ()

    @model_validator(mode="after")
    def _leaf_has_a_name(self) -> FleetConfig:
        if self.leaf is not None and self.cluster is None:
            raise ValueError("leaf needs cluster: the name of this cluster's JetStream domain")
        if len(set(self.clusters)) != len(self.clusters):
            raise ValueError("clusters: a name is listed twice")
        if "hub" in (self.cluster, *self.clusters):
            raise ValueError("'hub' is the hub's own domain: name the cluster otherwise")
        return self


class KfpTarget(_Section):
    enabled: bool = False
    # Whose runs those are that KFP records with no namespace (single-user mode leaves
    # run_details.Namespace empty): the namespace KFP is installed in. A run's KFP rows are
    # deleted only when run_details names the run's namespace (docs/security.md).
    single_user_namespace: str = Field(default=KFP_SINGLE_USER_NAMESPACE, min_length=1)


class ArgoArchiveTarget(_Section):
    enabled: bool = False
    cluster_name: str = Field(default="default", min_length=1)


class MlMetadataTarget(_Section):
    """A KFP run's ML Metadata rows (docs/architecture.md, "ML Metadata")."""

    enabled: bool = False
    # The MySQL database (PostgreSQL schema) MLMD's tables are in, on database.url's server
    # (KFP's default: metadb). None: database.url's own.
    database: ColumnName | None = None  # an SQL identifier


class TektonResultsTarget(_Section):
    """Tekton Results' `results` and `records` rows of a run (PostgreSQL)."""

    enabled: bool = False


class ChildTable(_Section):
    table: TableName
    foreign_key_column: ColumnName


class TableTarget(_Section):
    """A user-declared table: delete rows where `key_column` = the run's key, children first."""

    name: TargetName
    table: TableName
    key_column: ColumnName
    key_from: KeyFrom = "uid"
    children: tuple[ChildTable, ...] = ()
    # The table's own record of when the run finished (a timestamp, or seconds since the
    # epoch; NULL or 0 while it runs): checked before its rows are deleted.
    finished_column: ColumnName | None = None
    # The table's own record of the run's namespace: when set, a run's rows are deleted only
    # if its row there names the namespace lapse stored with the run (another namespace:
    # `refused`). Without it a key taken from a label or annotation is the tenant's word
    # (docs/security.md, "Tenants and databases").
    namespace_column: ColumnName | None = None

    @property
    def key_source(self) -> tuple[Literal["uid", "name", "label", "annotation"], str | None]:
        """(`uid` | `name`, None) or (`label` | `annotation`, key)."""
        kind, _, key = self.key_from.partition(":")
        if kind == "label":
            return "label", key
        if kind == "annotation":
            return "annotation", key
        return ("uid" if kind == "uid" else "name"), None


class DatabaseTargets(_Section):
    kfp: KfpTarget = KfpTarget()
    argo_archive: ArgoArchiveTarget = ArgoArchiveTarget()
    ml_metadata: MlMetadataTarget = MlMetadataTarget()
    tekton_results: TektonResultsTarget = TektonResultsTarget()
    tables: tuple[TableTarget, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> DatabaseTargets:
        seen: set[str] = set()
        for table in self.tables:
            if table.name in ("kfp", "argo_archive", "ml_metadata", "tekton_results"):
                raise ValueError(f"tables: {table.name!r} is the name of a built-in target")
            if table.name in seen:
                raise ValueError(f"tables: the name {table.name!r} is used twice")
            seen.add(table.name)
        return self


# How long lapse waits on a server before it counts as down (docs/architecture.md, "Faults,
# tested"). A server that refuses is known at once; one that never answers (black-holed by
# a firewall, a dead node, a lost NAT entry) only when a timeout ends the wait, and then
# the event is waited out with back-off like any outage: these bound how long one try can
# hold a reaper, never whether the work is done.
DATABASE_CONNECT_TIMEOUT = timedelta(seconds=10)
DATABASE_STATEMENT_TIMEOUT = timedelta(seconds=60)
DATABASE_POOL_TIMEOUT = timedelta(seconds=30)
STORE_TIMEOUT = timedelta(seconds=60)
STORE_CONNECT_TIMEOUT = timedelta(seconds=3)


class DatabaseConfig(_Section):
    # Absent: `lapse demo` uses a local SQLite file.
    url: Annotated[str, AfterValidator(_database_url)] | None = Field(default=None, repr=False)
    targets: DatabaseTargets = DatabaseTargets()
    # Opening a connection (TCP, TLS, authentication).
    connect_timeout: PositiveDuration = DATABASE_CONNECT_TIMEOUT
    # One call of the row store: a read, or one batch's transaction (connecting, its
    # statements, its commit). Room for a batch of large deletes on a busy server.
    statement_timeout: PositiveDuration = DATABASE_STATEMENT_TIMEOUT
    # Waiting for a free connection of the pool (SQLAlchemy's pool_timeout).
    pool_timeout: PositiveDuration = DATABASE_POOL_TIMEOUT


# How long a watch lease outlives its holder's last renewal: a process killed with -9 has
# its kinds watched by another within this (plus a round, a quarter of it). Short enough
# that a finish is late by a few seconds at most; long enough that a busy event loop or a
# NATS leader election does not move the watches back and forth.
WATCH_LEASE_TTL = timedelta(seconds=6)


def _at_least_a_second(value: timedelta) -> timedelta:
    # NATS expires a bucket's keys on its own timer: below a second the lease would flap.
    if value < timedelta(seconds=1):
        raise ValueError("at least 1s")
    return value


class WatchLeaseConfig(_Section):
    """One watcher per kind among the `lapse up` processes sharing a NATS
    (lapse/runtime/watch_lease.py)."""

    # Unset: on when `lapse up` connects to a NATS it did not start itself (others may
    # share it); off with the embedded one (no other process can reach it).
    enabled: bool | None = None
    # Must be the same in every process: the first one makes the bucket with it.
    ttl: Annotated[PositiveDuration, AfterValidator(_at_least_a_second)] = WATCH_LEASE_TTL


class KubernetesConfig(_Section):
    # Neither kubeconfig nor in_cluster: the client's usual lookup ($KUBECONFIG, ~/.kube).
    kubeconfig: Path | None = None
    context: str | None = None
    in_cluster: bool = False
    # A client-side limit on API requests, like kubectl's --qps/--burst. Unset: none of
    # lapse's own (the API server's priority and fairness still applies).
    qps: float | None = Field(default=None, gt=0)
    burst: int | None = Field(default=None, ge=1)  # with qps; default: qps rounded down
    propagation_policy: Literal["Background", "Foreground", "Orphan"] = "Background"
    record_events: bool = False
    # Seconds a request (list, get, delete) waits to connect and for each read of the
    # answer: an API server that accepts and never answers is an outage after this long.
    request_timeout: float = Field(default=30.0, gt=0)
    # Seconds a watch asks the API server to run it (timeoutSeconds) before it is started
    # again; the client waits for its next byte this plus request_timeout at most.
    watch_timeout: int = Field(default=300, ge=1)
    watch_lease: WatchLeaseConfig = WatchLeaseConfig()

    @model_validator(mode="after")
    def _one_way_in(self) -> KubernetesConfig:
        if self.in_cluster and (self.kubeconfig is not None or self.context is not None):
            raise ValueError("in_cluster cannot be combined with kubeconfig or context")
        return self


# Below NATS's default max_payload (1 MiB): the stored message is the event re-encoded plus
# its headers, so the body needs room beside them.
DEFAULT_MAX_BODY_BYTES = 768 * 1024


class IngressConfig(_Section):
    """The HTTP ingress of `lapse up --listen` (pushed CloudEvents)."""

    # Larger bodies are refused with 413 (recorded). Must not exceed the NATS server's
    # max_payload, checked at start-up.
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    # Refusals recorded on the DLQ (and audit trail) per minute; beyond it they are only
    # counted (metric lapse.ingress.rejections), so a flood cannot fill the streams.
    max_records_per_minute: int = Field(default=60, ge=1)
    # A file holding the bearer token senders must present (`Authorization: Bearer ...`),
    # read once at start-up. Required when `--listen` is not a loopback address; on
    # loopback it applies when set. Only a file: a token in the environment or in this
    # file would show in `ps e`, in a ConfigMap, in a crash report.
    token_file: Path | None = None


# The safety net's defaults (lapse/operations/reconcile/periodic.py, docs/deploy.md "The
# safety net"): a lost event is planned within about this long. Ten minutes is short beside
# the TTLs lapse enforces (the default is 24 h: a deletion late by one period at worst, never
# early), and long enough that a pass (one paged list per kind and cleaned namespace, one
# schedule lookup per finished run) stays a small load beside the live traffic.
RECONCILE_PERIOD = timedelta(minutes=10)
RECONCILE_JITTER = timedelta(minutes=1)


class ReconcileConfig(_Section):
    """The periodic reconcile of the Knative shape: the Deployment lapse-policy-watcher
    plans, every `period` (plus up to `jitter`), the finished runs of the cleaned
    namespaces that have no schedule, and moves the stale ones. `lapse up` has its
    re-list lane instead and ignores this section."""

    enabled: bool = True
    period: PositiveDuration = RECONCILE_PERIOD
    # A random extra wait of up to this long before each pass (and before the first one
    # after a start), so passes do not line up with other periodic load.
    jitter: DurationField = RECONCILE_JITTER
    # Objects per list request (whole objects: the planner needs their status).
    page_size: int = Field(default=100, ge=1, le=1000)

    @model_validator(mode="after")
    def _jitter_within_period(self) -> ReconcileConfig:
        if self.jitter > self.period:
            raise ValueError("jitter is longer than period")
        return self


def _kinds(value: object) -> object:
    if isinstance(value, KindSet):
        return value
    if not isinstance(value, list | tuple):
        raise ValueError("a list of built-in kind names and kind declarations")
    entries: list[str | KindSpec] = [
        item if isinstance(item, str | KindSpec) else KindSpec.model_validate(item)
        for item in value
    ]
    return resolve_kinds(entries)


# The kinds lapse plans and deletes (events/kinds.py): a list of built-in names
# (argo-workflow, tekton-pipelinerun, tekton-taskrun, job, trainjob, and the opt-in
# rayjob, jobset, sparkapplication) and declarations.
Kinds = Annotated[
    KindSet,
    BeforeValidator(_kinds),
    PlainSerializer(lambda kinds: [spec.model_dump(mode="json") for spec in kinds]),
]


class ArtifactsSection(ArtifactsConfig):
    """lapse.yaml's `artifacts`: the stores (the artifact-reaper's own configuration) and
    how long the object store client waits on them, which only the edge reads."""

    # One request (obstore's retries of it included: they stop when it is spent). Room for
    # a DeleteObjects of 1,000 keys on a slow server (SeaweedFS on 2 busy cores: up to 4 s).
    timeout: PositiveDuration = STORE_TIMEOUT
    # Opening a connection.
    connect_timeout: PositiveDuration = STORE_CONNECT_TIMEOUT


class LapseConfig(_Section):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    nats: NatsConfig = NatsConfig()
    database: DatabaseConfig = DatabaseConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    policies: Policies = ()
    safety: SafetyConfig = SafetyConfig()
    ingress: IngressConfig = IngressConfig()
    kinds: Kinds = Field(default_factory=lambda: resolve_kinds(DEFAULT_KIND_NAMES))
    # The object stores of the artifacts target (functions/artifact_reaper/stores.py).
    artifacts: ArtifactsSection = ArtifactsSection()
    # The Knative shape's periodic reconcile (the safety net).
    reconcile: ReconcileConfig = ReconcileConfig()
    # Many clusters, one view (docs/fleet.md).
    fleet: FleetConfig = FleetConfig()
