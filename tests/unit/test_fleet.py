"""The fleet's pure parts (docs/fleet.md): the hub's and a leaf's nats-server settings, the
hub's stream sources, the cluster named by a hub subject, and the `fleet:` configuration.
tests/e2e/test_fleet.py runs them on real servers."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from lapse.config import LapseConfig
from lapse.edges.fleet_streams import FLEET_AUDIT, FLEET_EVENTS, cluster_of, hub_stream_configs
from lapse.embedded.fleet_identities import (
    HUB_ADMIN,
    HUB_READER,
    LeafLink,
    hub_password_variables,
    hub_settings,
    hub_users,
    leaf_settings,
    leaf_user,
)


def test_each_leaf_identity_is_allowed_its_own_cluster_only() -> None:
    clusters = ("east", "west")
    passwords = {user: f"pw-{user}" for user in hub_users(clusters)}
    settings = hub_settings(clusters, passwords, leaf_listen="0.0.0.0:7422")
    assert settings["jetstream"] == {"domain": "hub"}
    assert settings["leafnodes"] == {"listen": "0.0.0.0:7422"}
    users = {u["user"]: u for u in settings["authorization"]["users"]}
    assert set(users) == {HUB_ADMIN.user, HUB_READER.user, "lapse-leaf-east", "lapse-leaf-west"}
    east = users["lapse-leaf-east"]["permissions"]
    assert east == {
        "publish": {"allow": ["lapse.fleet.east.deliver.>", "$JSC.R.>"]},
        "subscribe": {"allow": ["$JS.east.API.>", "$JS.FC.>"]},
    }
    assert "west" not in str(east)
    assert users["lapse-leaf-west"]["password"] == "pw-lapse-leaf-west"
    assert hub_password_variables(("east",))["lapse-leaf-east"] == "LAPSE_LEAF_EAST_PASSWORD"


def test_a_leaf_keeps_its_own_domain_and_denies_the_hub_its_streams_and_durables() -> None:
    link = LeafLink(
        cluster="east",
        urls=("nats-leaf://hub.example:7422", "tls://hub2.example:7422"),
        user=leaf_user("east"),
        password="p@ss/word",
        ca_file="/etc/ca.pem",
    )
    settings = leaf_settings(link, ("lapse-object-reaper-due",))
    assert settings["jetstream"] == {"domain": "east"}
    (remote,) = settings["leafnodes"]["remotes"]
    # The password is quoted into the URL: nats-server takes leaf credentials nowhere else.
    assert remote["urls"] == [
        "nats-leaf://lapse-leaf-east:p%40ss%2Fword@hub.example:7422",
        "tls://lapse-leaf-east:p%40ss%2Fword@hub2.example:7422",
    ]
    assert remote["tls"] == {"ca_file": "/etc/ca.pem"}
    deny = remote["deny_imports"]
    for subject in (
        "lapse.sched.>",
        "lapse.due.>",
        "lapse.audit.>",
        "$KV.>",
        "$JS.east.API.STREAM.>",
        "$JS.east.API.CONSUMER.CREATE.*.lapse-object-reaper-due",
    ):
        assert subject in deny
    # Not all of lapse.>: the hub's interest in its deliver subjects must cross.
    assert "lapse.>" not in deny and not any(d.startswith("lapse.fleet") for d in deny)


def test_the_hub_sources_each_cluster_from_its_domain_with_the_cluster_in_the_subject() -> None:
    audit, events = hub_stream_configs(("east", "west"), audit_max_age=timedelta(days=3))
    assert (audit.name, events.name) == (FLEET_AUDIT, FLEET_EVENTS)
    assert audit.max_age == timedelta(days=3).total_seconds()
    assert not audit.subjects  # only what the sources bring
    assert audit.sources is not None and events.sources is not None
    east = audit.sources[0]
    assert east.name == "LAPSE_AUDIT" and east.external is not None
    assert east.external.api == "$JS.east.API"
    assert east.external.deliver == "lapse.fleet.east.deliver.audit"
    (transform,) = east.subject_transforms or []
    assert (transform.src, transform.dest) == ("lapse.audit.>", "lapse.fleet.east.audit.>")
    (west_events,) = events.sources[1].subject_transforms or []
    assert west_events.dest == "lapse.fleet.west.events.>"


@pytest.mark.parametrize(
    ("subject", "cluster"),
    [
        ("lapse.fleet.east.audit.dev.lapse.cleanup.completed.v1", "east"),
        ("lapse.fleet.west.events.x", "west"),
        ("lapse.audit.dev.lapse.cleanup.completed.v1", None),
        ("lapse.fleet.east", None),
        ("", None),
    ],
)
def test_the_cluster_is_read_from_the_hub_subject(subject: str, cluster: str | None) -> None:
    assert cluster_of(subject) == cluster


def _fleet(**fleet: object) -> LapseConfig:
    return LapseConfig.model_validate({"fleet": fleet})


LEAF = {"url": "nats-leaf://hub:7422", "user": "lapse-leaf-east", "password_file": "/p"}


def test_the_fleet_configuration() -> None:
    config = _fleet(cluster="east", leaf=LEAF, clusters=["east", "west"])
    assert config.fleet.leaf is not None
    assert config.fleet.leaf.password_file == Path("/p")
    assert LapseConfig().fleet.cluster is None  # one cluster, no hub: the default
    hub = _fleet(hub={"url": "nats://hub:4222", "user": "r", "password_file": "/p"}).fleet.hub
    assert hub is not None and hub.as_nats().user == "r"


@pytest.mark.parametrize(
    ("fleet", "said"),
    [
        ({"leaf": LEAF}, "leaf needs cluster"),
        ({"cluster": "hub"}, "'hub' is the hub's own domain"),
        ({"cluster": "East.1"}, "is not a cluster name"),
        ({"clusters": ["a", "a"]}, "listed twice"),
        ({"cluster": "e", "leaf": {**LEAF, "url": "nats-leaf://u:p@hub:7422"}}, "no credentials"),
        ({"cluster": "e", "leaf": {**LEAF, "url": "nats://hub:4222"}}, "not a leaf node URL"),
        ({"hub": {"url": "nats://hub:4222", "user": "r"}}, "go together"),
    ],
)
def test_a_wrong_fleet_configuration_is_refused(fleet: dict[str, object], said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        _fleet(**fleet)


def test_history_reads_the_hub_only_when_asked_and_configured() -> None:
    import argparse

    from lapse.cli.common import UsageError
    from lapse.cli.history import _cluster_name, fleet_config

    local = argparse.Namespace(fleet=False, cluster=None)
    hub = {"url": "nats://hub:4222", "user": "lapse-hub-reader", "password_file": "/p"}
    assert fleet_config(_fleet(hub=hub), local) is None
    config = fleet_config(_fleet(hub=hub), argparse.Namespace(fleet=False, cluster="east"))
    assert config is not None and config.nats.url == "nats://hub:4222"
    assert config.nats.user == "lapse-hub-reader"
    with pytest.raises(UsageError, match=r"set fleet\.hub\.url"):
        fleet_config(LapseConfig(), argparse.Namespace(fleet=True, cluster=None))
    # A cluster name is a token of the hub's subjects: no wildcard reads every cluster.
    assert _cluster_name("east-1") == "east-1"
    for bad in ("*", ">", "a.b", "East"):
        with pytest.raises(argparse.ArgumentTypeError):
            _cluster_name(bad)
