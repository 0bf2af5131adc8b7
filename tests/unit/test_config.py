"""The configuration loader: defaults, a full file, environment overrides, one-line errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import BaseModel

from lapse.config import ConfigError, LapseConfig, load_config
from lapse.events.run import Engine, RunRef, Target
from lapse.functions.durations import NEVER
from lapse.functions.policy import Action, plan

EXAMPLE = Path(__file__).resolve().parents[2] / "lapse.example.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lapse.yaml"
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str | None, env: dict[str, str] | None = None) -> str:
    """The one-line message for a file (relative name, as an admin would pass it) + env."""
    path = None if text is None else write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env or {})
    message = str(caught.value)
    assert "\n" not in message
    return message.replace(str(tmp_path) + "/", "")


# --- defaults ---------------------------------------------------------------------------


def test_no_file_and_no_environment_gives_the_documented_defaults() -> None:
    config = load_config(env={})
    assert config.nats.url is None  # the caller starts an embedded server
    assert config.nats.streams.model_dump() == {
        "schedule": "LAPSE_SCHED",
        "events": "LAPSE_EVENTS",
        "audit": "LAPSE_AUDIT",
        "dlq": "LAPSE_DLQ",
    }
    assert (config.nats.replicas, config.nats.max_deliver) == (1, 5)
    assert config.nats.audit_max_age == timedelta(days=30)
    assert config.nats.ack_wait == timedelta(seconds=4)
    assert config.database.url is None
    assert not config.database.targets.kfp.enabled
    assert config.database.targets.argo_archive.cluster_name == "default"
    assert config.database.targets.tables == ()
    seconds = (
        config.database.connect_timeout,
        config.database.statement_timeout,
        config.database.pool_timeout,
        config.artifacts.timeout,
        config.artifacts.connect_timeout,
    )
    assert [t.total_seconds() for t in seconds] == [10, 60, 30, 60, 3]
    assert (config.kubernetes.qps, config.kubernetes.burst) == (None, None)  # no limit
    assert config.kubernetes.propagation_policy == "Background"
    assert (config.kubernetes.request_timeout, config.kubernetes.watch_timeout) == (30.0, 300)
    assert config.policies == ()
    assert config.safety.dry_run is False
    assert config.safety.namespaces.include == ("*",)
    assert config.safety.max_deletions_per_second == 50
    assert config.safety.mass_deletion_brake.max_due == 1000
    assert config.safety.mass_deletion_brake.window == timedelta(seconds=60)
    assert config.safety.wait_for_archiving and config.safety.wait_for_kfp_persisted
    assert config.safety.gate_retry.max_wait == timedelta(hours=1)
    assert config.safety.gate_retry.backoff == timedelta(seconds=10)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_file_means_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text), env={}) == LapseConfig()


def test_the_path_comes_from_lapse_config_unless_given(tmp_path: Path) -> None:
    from_env = write(tmp_path, "safety: {dry_run: true}\n")
    explicit = tmp_path / "other.yaml"
    explicit.write_text("safety: {dry_run: false}\n")
    assert load_config(env={"LAPSE_CONFIG": str(from_env)}).safety.dry_run is True
    assert load_config(explicit, env={"LAPSE_CONFIG": str(from_env)}).safety.dry_run is False
    assert load_config(env={"LAPSE_CONFIG": ""}) == LapseConfig()


# --- a full file ------------------------------------------------------------------------

FULL = """\
nats:
  url: nats://a:4222,nats://b:4222
  streams: {schedule: S, events: E, audit: A, dlq: D}
  replicas: 3
  placement: {cluster: east, tags: [ssd, "az:1"]}
  audit_max_age: 90d
  max_deliver: 8
  ack_wait: 2m
database:
  url: postgresql://lapse:pw@db/lapse
  connect_timeout: 2s
  statement_timeout: 5s
  pool_timeout: 1s
  targets:
    kfp: {enabled: true}
    argo_archive: {enabled: true, cluster_name: east}
    tables:
      - name: artifacts
        table: ml.artifacts
        key_column: run_uid
        key_from: annotation:example.com/run
        children:
          - {table: ml.files, foreign_key_column: artifact_run}
kubernetes:
  kubeconfig: /etc/kube/config
  context: prod
  qps: 20.5
  burst: 40
  propagation_policy: Foreground
  record_events: true
  request_timeout: 5
  watch_timeout: 60
policies:
  - name: ci
    match: {engines: [argo], namespaces: ["ci-*"], has_labels: [pipeline/runid]}
    kubernetes: {ttl: 1h, after_failure: 1d}
  - name: default
    kubernetes: {ttl: 12h}
    database: {ttl: never}
safety:
  dry_run: true
  namespaces: {include: ["team-*", ci-1], exclude: [kube-system]}
  max_deletions_per_second: 5
  mass_deletion_brake: {enabled: false, max_due: 10, window: 5m}
  wait_for_archiving: false
  wait_for_kfp_persisted: false
  gate_retry: {max_wait: 30m, backoff: 30s}
artifacts:
  timeout: 20s
  connect_timeout: 1s
"""


def test_a_full_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL), env={})
    assert config.nats.url == "nats://a:4222,nats://b:4222"
    assert config.nats.streams.dlq == "D"
    assert (config.nats.replicas, config.nats.max_deliver) == (3, 8)
    assert config.nats.placement.cluster == "east"
    assert config.nats.placement.tags == ("ssd", "az:1")
    assert config.nats.audit_max_age == timedelta(days=90)
    assert config.nats.ack_wait == timedelta(minutes=2)
    assert config.database.targets.argo_archive.cluster_name == "east"
    assert (config.database.connect_timeout, config.database.statement_timeout) == (
        timedelta(seconds=2),
        timedelta(seconds=5),
    )
    assert config.database.pool_timeout == timedelta(seconds=1)
    assert (config.artifacts.timeout, config.artifacts.connect_timeout) == (
        timedelta(seconds=20),
        timedelta(seconds=1),
    )
    table = config.database.targets.tables[0]
    assert (table.table, table.key_column) == ("ml.artifacts", "run_uid")
    assert table.key_source == ("annotation", "example.com/run")
    assert table.children[0].foreign_key_column == "artifact_run"
    assert config.kubernetes.kubeconfig == Path("/etc/kube/config")
    assert (config.kubernetes.qps, config.kubernetes.propagation_policy) == (20.5, "Foreground")
    assert (config.kubernetes.request_timeout, config.kubernetes.watch_timeout) == (5.0, 60)
    assert [p.name for p in config.policies] == ["ci", "default"]
    assert config.policies[1].database is not None
    assert config.policies[1].database.ttl is NEVER
    assert config.safety.namespaces.include == ("team-*", "ci-1")
    assert config.safety.mass_deletion_brake.window == timedelta(minutes=5)
    assert config.safety.gate_retry.backoff == timedelta(seconds=30)


def test_loaded_policies_drive_the_policy_engine(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    config = load_config(write(tmp_path, FULL), env={})
    finished = datetime(2026, 1, 1, tzinfo=UTC)
    run = RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace="ci-7",
        name="wf",
        uid="u1",
        phase="Failed",
        finished_at=finished,
        labels={"pipeline/runid": "r"},
    )
    decisions = plan(run, config.policies, finished)
    assert decisions[Target.KUBERNETES].policy == "policy:ci"
    assert decisions[Target.KUBERNETES].deadline == finished + timedelta(days=1)
    assert decisions[Target.DATABASE].action is Action.CANCEL
    assert decisions[Target.DATABASE].policy == "policy:default"


# --- environment overrides --------------------------------------------------------------


def test_environment_overrides_win_over_the_file(tmp_path: Path) -> None:
    env = {
        "LAPSE_NATS__URL": "nats://override:4222",
        "LAPSE_NATS__STREAMS__DLQ": "DEAD",
        "LAPSE_NATS__ACK_WAIT": "45s",
        "LAPSE_DATABASE__TARGETS__KFP__ENABLED": "false",
        "LAPSE_KUBERNETES__QPS": "7.5",
        "LAPSE_SAFETY__DRY_RUN": "false",
        "LAPSE_SAFETY__NAMESPACES__EXCLUDE": "kube-*, argo ,",
        "LAPSE_SAFETY__MASS_DELETION_BRAKE__MAX_DUE": "25",
    }
    config = load_config(write(tmp_path, FULL), env=env)
    assert config.nats.url == "nats://override:4222"
    assert config.nats.streams.dlq == "DEAD"
    assert config.nats.streams.audit == "A"  # siblings from the file survive
    assert config.nats.ack_wait == timedelta(seconds=45)
    assert config.database.targets.kfp.enabled is False
    assert config.kubernetes.qps == 7.5
    assert config.safety.dry_run is False
    assert config.safety.namespaces.exclude == ("kube-*", "argo")
    assert config.safety.namespaces.include == ("team-*", "ci-1")
    assert config.safety.mass_deletion_brake.max_due == 25
    assert config.safety.mass_deletion_brake.window == timedelta(minutes=5)


def test_an_empty_override_unsets_an_optional_key(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL), env={"LAPSE_DATABASE__URL": ""})
    assert config.database.url is None  # back to the demo's SQLite


def test_overrides_work_without_a_file() -> None:
    config = load_config(env={"LAPSE_SAFETY__DRY_RUN": "yes", "LAPSE_NATS__REPLICAS": "3"})
    assert (config.safety.dry_run, config.nats.replicas) == (True, 3)


def test_lapse_variables_without_a_double_underscore_are_not_overrides() -> None:
    assert load_config(env={"LAPSE_DEBUG": "1", "LAPSE_LOG_LEVEL": "x"}) == LapseConfig()


# --- errors: one line, naming the key ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "policies:\n"
            "  - {name: a, match: {namespaces: [a]}, kubernetes: {ttl: 1h}}\n"
            "  - {name: b, match: {namespaces: [b]}, kubernetes: {ttl: 1h}}\n"
            "  - {name: c, kubernetes: {ttl: 3x}}\n",
            "lapse.yaml: policies[2].kubernetes.ttl: '3x' is not a duration "
            "(unknown unit 'x'; use s, m, h, d or w)",
        ),
        (
            "nats:\n  url: nats://x\n  urll: nats://y\n",
            "lapse.yaml: nats.urll: unknown key (expected one of: url, streams, replicas, "
            "placement, audit_max_age, max_deliver, ack_wait, user, password, password_file, "
            "token, token_file, nkey_file, creds_file, tls)",
        ),
        (
            "natz: {}\n",
            "lapse.yaml: natz: unknown key (expected one of: nats, database, "
            "kubernetes, policies, safety, ingress, kinds, artifacts, reconcile, fleet)",
        ),
        (
            "policies:\n  - name: a\n    kubernetes: {ttl: 1h, after_error: 1h}\n",
            "lapse.yaml: policies[0].kubernetes.after_error: unknown key (expected one of: "
            "ttl, after_success, after_failure)",
        ),
        (
            "nats:\n  url: x\n   bad: 1\n",
            "lapse.yaml:3:7: invalid YAML: mapping values are not allowed here",
        ),
        (
            "nats:\n  replicas: 1\n  replicas: 3\n",
            "lapse.yaml:3:3: invalid YAML: duplicate key 'replicas'",
        ),
        (
            "- nats\n",
            "lapse.yaml: the top level must be a mapping of sections (nats, "
            "database, kubernetes, policies, safety, ingress, kinds, artifacts, reconcile, fleet)",
        ),
        ("nats: [1]\n", "lapse.yaml: nats: expected a mapping of keys, got a list"),
        (
            "safety: {dry_run: maybe}\n",
            "lapse.yaml: safety.dry_run: 'maybe' is not a boolean (use true or false)",
        ),
        (
            "nats: {replicas: 0}\n",
            "lapse.yaml: nats.replicas: 0 should be greater than or equal to 1",
        ),
        ("nats: {ack_wait: 0s}\n", "lapse.yaml: nats.ack_wait: must be longer than 0s"),
        (
            "database: {statement_timeout: 0s}\n",
            "lapse.yaml: database.statement_timeout: must be longer than 0s",
        ),
        ("artifacts: {timeout: 0s}\n", "lapse.yaml: artifacts.timeout: must be longer than 0s"),
        (
            "nats: {streams: {dlq: lapse.dlq}}\n",
            "lapse.yaml: nats.streams.dlq: 'lapse.dlq' is "
            "not a stream name (1-32 letters, digits, '-' "
            "or '_')",
        ),
        (
            "nats: {streams: {dlq: LAPSE_AUDIT}}\n",
            "lapse.yaml: nats.streams: stream names "
            "must differ: LAPSE_SCHED, LAPSE_EVENTS, "
            "LAPSE_AUDIT, LAPSE_AUDIT",
        ),
        (
            "kubernetes: {propagation_policy: background}\n",
            "lapse.yaml: "
            "kubernetes.propagation_policy: 'background' should be 'Background', 'Foreground' "
            "or 'Orphan'",
        ),
        (
            "kubernetes: {in_cluster: true, context: prod}\n",
            "lapse.yaml: kubernetes: in_cluster cannot be combined with kubeconfig or context",
        ),
        (
            "kubernetes: {context: no}\n",
            "lapse.yaml: kubernetes.context: False is not text (quote it in YAML)",
        ),
        (
            "database:\n  targets:\n    tables:\n      - {name: t, table: 'runs; drop table x',"
            " key_column: id}\n",
            "lapse.yaml: database.targets.tables[0].table: 'runs; drop table x' is not an SQL "
            "table name ([schema.]table, letters/digits/_)",
        ),
        (
            "database:\n  targets:\n    tables:\n      - {name: t, table: runs, key_column: id,"
            " key_from: 'labels:x'}\n",
            "lapse.yaml: database.targets.tables[0].key_from: 'labels:x' is not a key source "
            "(uid, name, label:<key> or annotation:<key>)",
        ),
        (
            "database:\n  targets:\n    tables:\n      - {name: kfp, table: r, key_column: id}\n",
            "lapse.yaml: database.targets: tables: 'kfp' is the name of a built-in target",
        ),
        (
            "database:\n  targets:\n    tables:\n      - {name: t, table: a, key_column: id}\n"
            "      - {name: t, table: b, key_column: id}\n",
            "lapse.yaml: database.targets: tables: the name 't' is used twice",
        ),
        (
            "database:\n  targets:\n    tables:\n      - {name: t, key_column: id}\n",
            "lapse.yaml: database.targets.tables[0].table: required key is missing",
        ),
        (
            "safety: {namespaces: {include: []}}\n",
            "lapse.yaml: safety.namespaces: include is "
            "empty, so no namespace would be handled (use ['*'])",
        ),
        (
            "safety: {gate_retry: {max_wait: 1m, backoff: 2m}}\n",
            "lapse.yaml: safety.gate_retry: backoff is longer than max_wait",
        ),
        (
            "policies:\n  - {name: all, kubernetes: {ttl: 1d}}\n"
            "  - {name: ci, match: {namespaces: [ci]}, kubernetes: {ttl: 1h}}\n",
            "lapse.yaml: policies: policy 'ci' (index 1) never sets the kubernetes TTL: 'all' "
            "(index 0) matches every run first",
        ),
        (
            "policies:\n  - name: a\n    match: {labels: {pipeline/runid: 7}}\n"
            "    database: {ttl: 1d}\n",
            "lapse.yaml: policies[0].match.labels['pipeline/runid']: 7 is not text (quote it "
            "in YAML)",
        ),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    assert config_error(tmp_path, text) == message


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"LAPSE_SAFETY__DRY_RUN": "maybe"},
            "LAPSE_SAFETY__DRY_RUN: 'maybe' is not a boolean (use true or false)",
        ),
        ({"LAPSE_NATS__REPLICAS": "three"}, "LAPSE_NATS__REPLICAS: 'three' is not a whole number"),
        (
            {"LAPSE_NATS__ACK_WAIT": "30"},
            "LAPSE_NATS__ACK_WAIT: '30' is not a duration (missing unit; use s, m, h, d or w)",
        ),
        (
            {"LAPSE_NATS__URLL": "x"},
            "LAPSE_NATS__URLL: unknown setting 'nats.urll' (expected one of: url, streams, "
            "replicas, placement, audit_max_age, max_deliver, ack_wait, user, password, "
            "password_file, token, token_file, nkey_file, creds_file, tls)",
        ),
        (
            {"LAPSE_NATZ__URL": "x"},
            "LAPSE_NATZ__URL: unknown setting 'natz' (expected one of: nats, database, "
            "kubernetes, policies, safety, ingress, kinds, artifacts, reconcile, fleet)",
        ),
        (
            {"LAPSE_NATS__STREAMS": "x"},
            "LAPSE_NATS__STREAMS: 'nats.streams' is a section; set one of its keys",
        ),
        ({"LAPSE_NATS__URL__HOST": "x"}, "LAPSE_NATS__URL__HOST: 'nats.url' has no keys below it"),
        (
            {"LAPSE_POLICIES__0__NAME": "x"},
            "LAPSE_POLICIES__0__NAME: 'policies' can only be set in the config file",
        ),
        (
            {"LAPSE_NATS____URL": "x"},
            "LAPSE_NATS____URL: malformed override name (use LAPSE_<SECTION>__<KEY>, "
            "e.g. LAPSE_NATS__URL)",
        ),
        (
            {"LAPSE_SAFETY__NAMESPACES__INCLUDE": " , "},
            "environment: safety.namespaces: include is empty, so no namespace would be handled "
            "(use ['*']) (overridden: LAPSE_SAFETY__NAMESPACES__INCLUDE)",
        ),
        (
            {"LAPSE_NATS__URL": "localhost:4222"},
            "LAPSE_NATS__URL: not a NATS URL (nats://host:4222, tls://, ws:// or wss://; several "
            "separated by commas)",
        ),
        (
            {"LAPSE_CONFIG": "/nonexistent/lapse.yaml"},
            "/nonexistent/lapse.yaml: file not found (from LAPSE_CONFIG)",
        ),
    ],
)
def test_environment_errors_name_the_variable(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    assert config_error(tmp_path, None, env) == message


def test_an_override_error_names_the_variable_even_with_a_file(tmp_path: Path) -> None:
    message = config_error(tmp_path, FULL, {"LAPSE_SAFETY__DRY_RUN": "maybe"})
    assert message == "LAPSE_SAFETY__DRY_RUN: 'maybe' is not a boolean (use true or false)"


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^.*/absent\.yaml: file not found$"):
        load_config(tmp_path / "absent.yaml", env={})


def test_an_unreadable_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r": cannot read: Is a directory$"):
        load_config(tmp_path, env={})


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("::not a url::", "not a SQLAlchemy URL"),
        ("oracle://scott:tiger-secret@db/orcl", "unsupported database 'oracle'"),
    ],
)
def test_database_url_errors_never_echo_the_url(tmp_path: Path, url: str, problem: str) -> None:
    message = config_error(tmp_path, None, {"LAPSE_DATABASE__URL": url})
    assert message.startswith(f"LAPSE_DATABASE__URL: {problem}")
    assert "secret" not in message and url not in message


def test_several_problems_are_counted_and_all_kept(tmp_path: Path) -> None:
    path = write(tmp_path, "nats: {replicas: 0, max_deliver: 0}\nsafety: {dry_run: maybe}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert str(caught.value).endswith("(and 2 more problems)")
    assert len(caught.value.problems) == 3
    assert any("safety.dry_run" in problem for problem in caught.value.problems)


# --- the example file -------------------------------------------------------------------


def test_the_example_file_loads() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.policies, "the example should show policies"
    # What the loader accepts it can also write back (e.g. for `lapse config show`).
    assert LapseConfig.model_validate(config.model_dump(mode="json")) == config


def _missing_keys(model: type[BaseModel], data: Any, path: str) -> list[str]:
    """Model fields that the example never spells out (lists: across all their items)."""
    items = data if isinstance(data, list) else [data]
    mappings = [item for item in items if isinstance(item, dict)]
    missing = []
    for name, field in model.model_fields.items():
        present = [m[name] for m in mappings if name in m]
        if not present:
            missing.append(f"{path}{name}")
            continue
        nested = [
            arg
            for arg in (field.annotation, *get_args(field.annotation))
            if isinstance(arg, type) and issubclass(arg, BaseModel)
        ]
        if nested:
            values = [
                v for value in present for v in (value if isinstance(value, list) else [value])
            ]
            missing += _missing_keys(nested[0], values, f"{path}{name}.")
    return missing


def test_the_example_file_documents_every_key() -> None:
    # Adding a setting without documenting it in lapse.example.yaml fails here.
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert _missing_keys(LapseConfig, raw, "") == []
