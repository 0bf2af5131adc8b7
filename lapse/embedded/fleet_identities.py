"""Who may do what between a fleet's hub and its clusters (docs/fleet.md): the hub's own
identities, one leaf identity per cluster, and the nats-server configuration of both ends.

Each cluster's NATS is a leaf node of the hub with a JetStream domain of its own (the
cluster's name), so its schedules are stored and fire there, whether the hub is reachable
or not. The hub sources every cluster's outcomes and lifecycle events into its own streams
(lapse/edges/fleet_streams.py): it asks the cluster's domain for a consumer
(`$JS.<cluster>.API.>`, over the leaf connection) that delivers to
`lapse.fleet.<cluster>.deliver.>`, answered on the hub's `$JSC.R.>` inboxes.

The hub enforces what each leaf connection carries, by the permissions of the identity the
leaf logs in as (a leaf's `publish` is what it may send into the hub, its `subscribe` what
the hub forwards to it): `lapse-leaf-<cluster>` may deliver its own cluster's events and
answer the hub, and receives its own domain's API requests only. A cluster whose NATS is
in an attacker's hands can forge its own events at worst, never another cluster's, and
reaches no other domain's API, nor the hub's. The cluster end guards itself the same way
(`deny_imports` on its remote): the hub may create consumers that read its streams, never
change or delete a stream, touch lapse's durable consumers, or put a message on lapse's
subjects. The identities of one cluster (nats_identities) are unchanged by the fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from lapse.embedded.nats_identities import JS_READ, Identity, password_variable
from lapse.events.subjects import (
    AUDIT_PREFIX,
    DLQ_PREFIX,
    DUE_PREFIX,
    EVENTS_PREFIX,
    SCHEDULE_PREFIX,
)

# The hub's own JetStream domain: a cluster may not take this name (lapse.config checks).
HUB_DOMAIN: Final = "hub"
FLEET_PREFIX: Final = "lapse.fleet"
# The hub's JetStream API answers its own requests to a cluster's domain on these inboxes
# (nats-server's internal `$JSC.R.<token>`; checked on nats-server 2.15).
HUB_REPLIES: Final = "$JSC.R.>"
# Flow control of a source consumer: the hub answers it toward the cluster.
FLOW_CONTROL: Final = "$JS.FC.>"


# lapse's own subjects in a cluster (lapse/events/subjects.py): the hub puts nothing there.
LAPSE_PREFIXES: Final = (SCHEDULE_PREFIX, DUE_PREFIX, EVENTS_PREFIX, AUDIT_PREFIX, DLQ_PREFIX)


def deliver_prefix(cluster: str) -> str:
    """Where the cluster's domain delivers what the hub sources from it."""
    return f"{FLEET_PREFIX}.{cluster}.deliver"


def leaf_user(cluster: str) -> str:
    return f"lapse-leaf-{cluster}"


def leaf_permissions(cluster: str) -> dict[str, Any]:
    """The hub's permissions of `cluster`'s leaf identity (see the module's docstring)."""
    return {
        "publish": {"allow": [f"{deliver_prefix(cluster)}.>", HUB_REPLIES]},
        "subscribe": {"allow": [f"$JS.{cluster}.API.>", FLOW_CONTROL]},
    }


# `lapse fleet apply`: creates and updates the hub's streams (and reads them).
HUB_ADMIN: Final = Identity(
    user="lapse-hub-admin",
    role="the hub's streams: lapse fleet apply",
    publish=("$JS.>",),
)
# `lapse history --fleet` and the other read-only commands on the hub.
HUB_READER: Final = Identity(
    user="lapse-hub-reader",
    role="read-only commands on the hub: history --fleet",
    publish=JS_READ,
    publish_deny=("lapse.>", "$KV.>"),
)
HUB_IDENTITIES: Final = (HUB_ADMIN, HUB_READER)


def hub_users(clusters: tuple[str, ...]) -> tuple[str, ...]:
    """Every user of the hub: its own identities, then one leaf identity per cluster."""
    return (*(i.user for i in HUB_IDENTITIES), *(leaf_user(c) for c in clusters))


def hub_settings(
    clusters: tuple[str, ...], passwords: dict[str, str], *, leaf_listen: str
) -> dict[str, Any]:
    """The hub's nats-server configuration (beside its client port and store): JetStream
    in the domain `hub`, the leaf node listener, and every hub user with its password
    (`passwords`: user -> password, or a `$VARIABLE` reference) and permissions. No
    anonymous user: a client or leaf without credentials is refused."""
    users: list[dict[str, Any]] = [
        {"user": i.user, "password": passwords[i.user], "permissions": i.permissions()}
        for i in HUB_IDENTITIES
    ]
    users += [
        {
            "user": leaf_user(cluster),
            "password": passwords[leaf_user(cluster)],
            "permissions": leaf_permissions(cluster),
        }
        for cluster in clusters
    ]
    return {
        "server_name": "lapse-hub",
        "jetstream": {"domain": HUB_DOMAIN},
        "leafnodes": {"listen": leaf_listen},
        "authorization": {"users": users},
    }


def hub_password_variables(clusters: tuple[str, ...]) -> dict[str, str]:
    """user -> the environment variable the hub reads its password from."""
    return {
        user: password_variable(Identity(user=user, role="", publish=()))
        for user in hub_users(clusters)
    }


@dataclass(frozen=True)
class LeafLink:
    """How a cluster's NATS reaches the hub: the hub's leaf node URLs (no credentials in
    them), the cluster's leaf identity and its password, and the hub's CA (tls://)."""

    cluster: str
    urls: tuple[str, ...]
    user: str
    password: str
    ca_file: str | None = None


def leaf_settings(link: LeafLink, durables: tuple[str, ...]) -> dict[str, Any]:
    """A cluster's nats-server configuration for the fleet: JetStream in its own domain
    and one remote to the hub, which may not change the cluster's streams, touch lapse's
    durable consumers (`durables`) or publish on lapse's subjects there."""
    auth = f"{quote(link.user, safe='')}:{quote(link.password, safe='')}@"
    urls = []
    for url in link.urls:
        scheme, _, rest = url.strip().partition("://")
        urls.append(f"{scheme}://{auth}{rest}")
    api = f"$JS.{link.cluster}.API"
    # Not all of lapse.>: the hub's interest in its deliver subjects (lapse.fleet.<cluster>.
    # deliver.>) crosses the same way, and a denied import is a denied interest too.
    deny = [
        *(f"{prefix}.>" for prefix in LAPSE_PREFIXES),
        "$KV.>",
        f"{api}.STREAM.>",
        f"{api}.CONSUMER.DURABLE.>",
        *(
            subject
            for durable in durables
            for subject in (
                f"{api}.CONSUMER.CREATE.*.{durable}",
                f"{api}.CONSUMER.CREATE.*.{durable}.>",
                f"{api}.CONSUMER.DELETE.*.{durable}",
                f"{api}.CONSUMER.MSG.NEXT.*.{durable}",
            )
        ),
    ]
    remote: dict[str, Any] = {"urls": urls, "deny_imports": deny}
    if link.ca_file is not None:
        remote["tls"] = {"ca_file": link.ca_file}
    return {
        "server_name": f"lapse-{link.cluster}",
        "jetstream": {"domain": link.cluster},
        "leafnodes": {"remotes": [remote]},
    }
