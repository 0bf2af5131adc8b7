"""Who may publish what on lapse's NATS: the identities and their subject permissions.

The trust mark (`Lapse-Observed`, events/observed.py) is believed only from messages on
subjects that only lapse's own identities may publish, delivered by lapse's own durable
consumer (lapse/runtime/trust.py); an open NATS would let anyone put a due event with the
mark and a forged finished state. So the server enforces, per user, the subjects each may
publish and subscribe to (its own inboxes only), and which durable consumers it may
create, update, fetch from and ack through (its own, by name: lapse/runtime/consumers.py
says which; docs/deploy.md, "NATS identities"). `lapse up`'s embedded
nats-server is started with these users (random passwords in its state directory, files
0600); infra/dev-nats/nats.conf grants the same sets to the Kubernetes components
(`python -m lapse.operations.nats_conf`), and tests/integration/test_infra_package.py
checks they agree.

Nobody but the server itself publishes `lapse.due.>` in normal operation: a schedule fires
into it by the server's internal publish, which user permissions do not apply to (checked
on a real server by tests/integration/test_nats_identities.py). Only the admin identity
may put a due event there by hand (`lapse dlq replay`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from lapse.embedded.process import write_private

# Every identity has inboxes of its own (`_INBOX_<user>.<random>`: lapse/edges/nats.py
# connects with that prefix) and may subscribe to no one else's. With `_INBOX.>` for all,
# any identity could learn `lapse up`'s pull inboxes and point a push consumer of a stream
# it may write at one of them: a forged due message would arrive where lapse waits for its
# own (issue 36). Nor may it publish into another's inbox: a message put there by hand can
# carry any reply subject, the JetStream metadata lapse's trust reads included.
INBOX: Final = "_INBOX.>"


def inbox_prefix(user: str) -> str:
    """The inbox prefix of the identity `user` (nats-py's `inbox_prefix`)."""
    return f"_INBOX_{user}"


# JetStream API requests that only read: account, stream and consumer info, message gets
# (the schedule store's last-message lookups, KV gets, the audit and dead letters read one
# message after another: lapse/edges/streams.py). No consumer of lapse's streams: a
# consumer create names its consumer in the request's body, so permission to create any
# one (an ephemeral included) is permission to update lapse's durables (an empty filter, a
# max_deliver of 1). Acks are publishes (`$JS.ACK.>`), granted only to who consumes.
JS_READ: Final = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.API.CONSUMER.LIST.*",
)

# The key-value buckets lapse writes (lapse/edges/limits.py, lapse/edges/health.py; a unit
# test checks the names agree).
KV_BUCKETS: Final = ("LAPSE_LIMITS", "LAPSE_HEALTH")
KV: Final = tuple(f"$KV.{bucket}.>" for bucket in KV_BUCKETS)
LIMITS_KV: Final = "$KV.LAPSE_LIMITS.>"
HEALTH_KV: Final = "$KV.LAPSE_HEALTH.>"
# The safety net's last pass only (lapse/edges/health.py, `reconcile.<process>`): written by
# the Deployment lapse-policy-watcher as the planner, for `lapse status`.
RECONCILE_HEALTH_KV: Final = "$KV.LAPSE_HEALTH.reconcile.>"
# The watcher's positions (lapse/edges/watch_positions.py): only `lapse up` watches.
WATCH_BUCKET: Final = "LAPSE_WATCH"
WATCH_KV: Final = f"$KV.{WATCH_BUCKET}.>"
# Each run's artifact capture (lapse/edges/artifacts/captures.py): written by the planner
# (and by the row-reaper: ML Metadata's account), read and removed by the artifact-reaper,
# which also keeps there the DELETEs it sent (`sent.<uid>.<digest>`).
CAPTURES_BUCKET: Final = "LAPSE_ARTIFACTS"
CAPTURES_KV: Final = f"$KV.{CAPTURES_BUCKET}.>"
# Which `lapse up` process watches which kind (lapse/edges/watch_leases.py): only `lapse
# up` watches, so only it takes, renews and releases leases.
LEASES_BUCKET: Final = "LAPSE_LEASES"
LEASES_KV: Final = f"$KV.{LEASES_BUCKET}.>"
ALL_BUCKETS: Final = (*KV_BUCKETS, WATCH_BUCKET, CAPTURES_BUCKET, LEASES_BUCKET)

# Listing a bucket's keys or watching it takes an ordered consumer, created without a name
# (nats-py) on the bucket's stream. Granted on the buckets' streams only: no durable of
# lapse's lives there, so such a create can update none of them, and what it delivers is
# no event of lapse's. `$JS.FC.>` answers an ordered consumer's flow control.
JS_KV_READ: Final = (
    *(f"$JS.API.CONSUMER.CREATE.KV_{bucket}" for bucket in ALL_BUCKETS),
    *(f"$JS.API.CONSUMER.CREATE.KV_{bucket}.>" for bucket in ALL_BUCKETS),
    "$JS.FC.>",
)

# Streams and buckets made or updated on first use (`lapse up` applies the definitions at
# start-up; the limits and captures buckets are made by who first needs them).
# Creating or updating a stream publishes by the server's hand: a stream's RePublish from a
# subject one may publish (lapse.events.>) onto lapse.due.> is accepted, and what it
# republishes is stored in LAPSE_SCHED with its headers (checked on nats-server 2.15). So
# only identities that may put schedules anyway (and thereby fire a due event) create or
# update streams.
JS_STREAM_CHANGES: Final = (
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
)
# Cancelling a schedule purges its subject from the schedule stream. A bucket's stream is
# purged by no one but the admin: a purge of LAPSE_LIMITS would release the brake.
JS_PURGE: Final = "$JS.API.STREAM.PURGE.>"
BUCKET_PURGES: Final = tuple(f"$JS.API.STREAM.PURGE.KV_{bucket}" for bucket in ALL_BUCKETS)

# Never, for anyone but the admin: deleting a stream or rewriting its messages.
JS_DESTRUCTIVE: Final = (
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
)

EVENTS: Final = "lapse.events.>"
SCHEDULES: Final = "lapse.sched.>"
DUE: Final = "lapse.due.>"
AUDIT: Final = "lapse.audit.>"
# Where a dead letter's `cleanup.failed` record goes on the audit stream (lapse/edges/
# publishing.py writes every dead letter there and to lapse.dlq.>). The bridge and the
# dead-letter sink record dead letters and nothing else: an outcome on the audit stream
# (`deleted`, which `lapse history` shows) is never theirs to write.
AUDIT_FAILED: Final = "lapse.audit.dev.lapse.cleanup.failed.v1"
DLQ: Final = "lapse.dlq.>"


def consumer_permissions(durables: tuple[str, ...]) -> tuple[str, ...]:
    """What an identity needs to consume through the durable consumers it owns: create or
    update them (by the name in the subject, in every form nats-py and the server have),
    fetch from them, delete one a renamed route replaced, and ack what they deliver. The
    stream is left open (`nats.streams` renames them); the name is lapse's own."""
    return tuple(
        subject
        for durable in durables
        for subject in (
            f"$JS.API.CONSUMER.CREATE.*.{durable}",
            f"$JS.API.CONSUMER.CREATE.*.{durable}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.*.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.*.{durable}",
            f"$JS.API.CONSUMER.DELETE.*.{durable}",
            # The ack subject names stream and consumer: `$JS.ACK.<stream>.<consumer>...`,
            # or with a domain and account hash before them (the v2 form).
            f"$JS.ACK.*.{durable}.>",
            f"$JS.ACK.*.*.*.{durable}.>",
        )
    )


@dataclass(frozen=True)
class Identity:
    """One NATS user: the subjects it may publish (allow, then deny) and subscribe to.
    Consumers are granted by name (`permissions(durables)`): the durables it owns come
    from the routes (lapse/runtime/consumers.py), which this layer does not read."""

    user: str
    role: str  # what it is for, in docs/deploy.md's table
    publish: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    # Beyond its own inboxes (a fleet hub's answers: lapse/embedded/fleet_identities.py).
    subscribe: tuple[str, ...] = ()

    @property
    def inbox(self) -> str:
        return inbox_prefix(self.user)

    def permissions(
        self, durables: tuple[str, ...] = (), retired: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The server's `permissions` block for this user, owning `durables`, and allowed
        to delete the `retired` ones (a renamed route's, once its successor took over)."""
        own = f"{self.inbox}.>"
        retiring = [f"$JS.API.CONSUMER.DELETE.*.{durable}" for durable in retired]
        publish: dict[str, list[str]] = {
            "allow": [*self.publish, *consumer_permissions(durables), *retiring, own]
        }
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        return {
            "publish": publish,
            # The deny is for the record (the allow grants no other inbox): `_INBOX.>` is
            # every client's default prefix.
            "subscribe": {"allow": [own, *self.subscribe], "deny": [INBOX]},
        }


# `lapse up`: watcher and ingress (lapse.events), planner and reapers (schedules, outcomes,
# dead letters, the buckets). Never lapse.due.>: only the server fires due messages, from
# the schedules. Its consumers are the routes' durables (granted by name).
PROCESS: Final = Identity(
    user="lapse",
    role="lapse up (watcher, ingress, planner, reapers, dispatcher)",
    publish=(
        EVENTS, SCHEDULES, AUDIT, DLQ, *KV, WATCH_KV, CAPTURES_KV, LEASES_KV,
        *JS_READ, *JS_KV_READ, *JS_STREAM_CHANGES, JS_PURGE,
    ),
    publish_deny=(DUE, *JS_DESTRUCTIVE, *BUCKET_PURGES),
)  # fmt: skip

# lapse status, history, plan, dlq list|show, brake status: read the streams (message by
# message) and the buckets (keys listed with an ordered consumer on the bucket's stream);
# publish nothing on lapse.* nor $KV.*, create or update no consumer of lapse's streams.
READER: Final = Identity(
    user="lapse-reader",
    role="read-only commands: status, history, plan, dlq list|show, brake status",
    publish=(*JS_READ, *JS_KV_READ),
    publish_deny=("lapse.>", "$KV.>", *JS_DESTRUCTIVE, *JS_STREAM_CHANGES),
)

# lapse dlq replay|purge, brake release, reconcile, infra apply: the operator's repairs. A
# replay publishes the due event where the scheduler fires it (lapse.due.>), a purge
# deletes DLQ entries, reconcile puts schedules, infra apply creates the streams.
ADMIN: Final = Identity(
    user="lapse-admin",
    role="repairs: dlq replay|purge, brake release, reconcile, infra apply",
    publish=("lapse.>", *KV, WATCH_KV, CAPTURES_KV, LEASES_KV, "$JS.>"),
)

EMBEDDED: Final = (PROCESS, READER, ADMIN)

# On Kubernetes each component has its own user (infra/dev-nats/nats.conf, generated from
# these; the production NATS is configured the same way: docs/deploy.md). `lapse up` in
# one Deployment is PROCESS; the streams Job runs `lapse infra apply` as ADMIN. None but
# the admin may publish lapse.due.>: the bridge reads due events, it never writes one. The
# functions consume nothing from NATS (the Broker delivers to them over HTTP).
_WORKER_DENY: Final = (DUE, *JS_DESTRUCTIVE, *BUCKET_PURGES)
_WORKER_JS: Final = (*JS_READ, *JS_KV_READ, *JS_STREAM_CHANGES, JS_PURGE)
PLANNER: Final = Identity(
    user="lapse-planner",
    role="ttl-planner function and the policy watcher: puts, replaces and cancels "
    "schedules, artifact captures, the safety net's last pass",
    publish=(SCHEDULES, AUDIT, DLQ, CAPTURES_KV, RECONCILE_HEALTH_KV, *_WORKER_JS),
    publish_deny=_WORKER_DENY,
)
OBJECT_REAPER: Final = Identity(
    user="lapse-object-reaper",
    role="object-reaper function: outcomes, reschedules, the shared deletion limits",
    publish=(SCHEDULES, AUDIT, DLQ, *KV, *_WORKER_JS),
    publish_deny=_WORKER_DENY,
)
# The row-reaper writes ML Metadata's account of a KFP run's artifacts into the run's
# capture before it deletes the run's MLMD rows (functions/artifact_reaper/metadata.py).
ROW_REAPER: Final = Identity(
    user="lapse-row-reaper",
    role="row-reaper function: outcomes, reschedules, the shared deletion limits, "
    "ML Metadata's account in artifact captures",
    publish=(SCHEDULES, AUDIT, DLQ, *KV, CAPTURES_KV, *_WORKER_JS),
    publish_deny=_WORKER_DENY,
)
ARTIFACT_REAPER: Final = Identity(
    user="lapse-artifact-reaper",
    role="artifact-reaper function (infra/components/artifacts): outcomes, reschedules, "
    "the shared deletion limits, artifact captures",
    publish=(SCHEDULES, AUDIT, DLQ, *KV, CAPTURES_KV, *_WORKER_JS),
    publish_deny=_WORKER_DENY,
)
# The bridge and the sink schedule nothing, so they change no stream either; they write
# dead letters only (the bridge's consumers are granted by name). Neither touches a bucket:
# the brake is the reapers' and the admin's.
BRIDGE: Final = Identity(
    user="lapse-bridge",
    role="lapse bridge: consumes due events and outcomes (its own durables), dead-letters",
    publish=(AUDIT_FAILED, DLQ, *JS_READ),
    publish_deny=(SCHEDULES, EVENTS, "$KV.>", *_WORKER_DENY, *JS_STREAM_CHANGES),
)
DLQ_SINK: Final = Identity(
    user="lapse-dlq-sink",
    role="dead-letter sink: stores what the Broker gave up on (dead letters only)",
    publish=(AUDIT_FAILED, DLQ, *JS_READ),
    publish_deny=(SCHEDULES, EVENTS, "$KV.>", *_WORKER_DENY, *JS_STREAM_CHANGES),
)
KUBERNETES: Final = (
    PROCESS, PLANNER, OBJECT_REAPER, ROW_REAPER, ARTIFACT_REAPER, BRIDGE, DLQ_SINK, READER,
    ADMIN,
)  # fmt: skip
# The Secret holding every Kubernetes identity's password, one key per user.
USERS_SECRET: Final = "lapse-nats-users"

# Which identity owns which durable consumers: user -> durable names
# (lapse/runtime/consumers.py says, from the routes).
Durables = Mapping[str, tuple[str, ...]]


# A password is read by nats-server as an unquoted value where the dev NATS's configuration
# names it by `$VARIABLE`; one starting with "-" or a digit and "-" or "." is lexed as a
# number and the server refuses the whole configuration (2.3% of token_urlsafe's values:
# the dev NATS crash-looped on the cluster). Letters and digits, a letter first: 43
# characters, over 250 bits.
_PASSWORD_ALPHABET: Final = string.ascii_letters + string.digits


def new_password() -> str:
    """A random password any nats-server configuration reads as a string."""
    rest = "".join(secrets.choice(_PASSWORD_ALPHABET) for _ in range(42))
    return secrets.choice(string.ascii_letters) + rest


def password_variable(identity: Identity) -> str:
    """The environment variable nats-server reads the identity's password from."""
    return identity.user.upper().replace("-", "_") + "_PASSWORD"


def kubernetes_conf(durables: Durables, retired: Durables | None = None) -> str:
    """infra/dev-nats/nats.conf: the users and permissions of KUBERNETES, each password a
    reference to an environment variable the NATS pod takes from the Secret
    (`password: $LAPSE_PLANNER_PASSWORD`; nats-server resolves it, so no password is in a
    ConfigMap)."""
    passwords = {i.user: f"@{password_variable(i)}@" for i in KUBERNETES}
    users = authorization(passwords, KUBERNETES, durables, retired)
    body = json.dumps(
        {
            "port": 4222,
            "http_port": 8222,
            "jetstream": {"store_dir": "/data"},
            **users,
        },
        indent=2,
    )
    body = re.sub(r'"@(\w+)@"', r"$\1", body)
    return (
        "# nats-server configuration of the dev NATS (infra/dev-nats/nats.yaml): one user per\n"
        '# lapse component, each with the subjects it may publish (docs/deploy.md, "NATS\n'
        '# identities"). Generated: python -m lapse.operations.nats_conf > this file\n'
        "# (tests/integration/test_infra_package.py checks it is current). Passwords are $VARs\n"
        "# the pod sets from the Secret lapse-nats-users.\n" + body + "\n"
    )


# Where `lapse up` keeps the passwords (one file per user, 0600, the directory 0700).
CREDENTIALS_DIR: Final = "nats-credentials"


def password_file(state_dir: Path, identity: Identity) -> Path:
    return state_dir / CREDENTIALS_DIR / f"{identity.user}.password"


def ensure_passwords(state_dir: Path) -> dict[str, str]:
    """Each embedded identity's password, generated at the first start and kept, so a
    command still connected (or started) during a restart of `lapse up` is not refused."""
    directory = state_dir / CREDENTIALS_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    passwords: dict[str, str] = {}
    for identity in EMBEDDED:
        path = password_file(state_dir, identity)
        with contextlib.suppress(FileNotFoundError):
            passwords[identity.user] = path.read_text(encoding="utf-8").strip()
        if not passwords.get(identity.user):
            passwords[identity.user] = new_password()
            write_private(path, passwords[identity.user] + "\n")
    return passwords


def authorization(
    passwords: dict[str, str],
    identities: tuple[Identity, ...],
    durables: Durables,
    retired: Durables | None = None,
) -> dict[str, Any]:
    """The server configuration's `authorization` block: every identity with its password
    and permissions, each owning its `durables` and allowed to delete its `retired` ones.
    No anonymous user: a client without credentials is refused."""
    retired = retired or {}
    return {
        "authorization": {
            "users": [
                {
                    "user": identity.user,
                    "password": passwords[identity.user],
                    "permissions": identity.permissions(
                        durables.get(identity.user, ()), retired.get(identity.user, ())
                    ),
                }
                for identity in identities
            ]
        }
    }


def write_config(path: Path, config: dict[str, Any]) -> None:
    """The server's configuration file (JSON, which nats-server reads), 0600: it holds the
    passwords."""
    write_private(path, json.dumps(config, indent=2) + "\n")
