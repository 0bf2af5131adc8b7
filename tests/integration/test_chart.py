"""The Helm chart (charts/lapse), as helm renders it: `helm lint --strict`, both shapes and
several value sets render, values.schema.json refuses wrong types and unknown keys, and
for the settings of each kustomize overlay (charts/lapse/ci/<overlay>-values.yaml) the
chart renders the same objects as `kubectl kustomize infra/overlays/<overlay>`.

What the comparison leaves aside, on purpose (docs/helm.md, "The chart and the kustomize
package"): Helm's standard labels (helm.sh/chart, app.kubernetes.io/managed-by, instance,
version) and its annotations (helm.sh/hook*, checksum/*, which roll pods when lapse.yaml
changes); the Namespace object (Helm installs into the release namespace, made by
`--create-namespace`); kustomize's hash suffix on the generated ConfigMap lapse-nats-conf;
the order of env, volumes and volumeMounts (a patch appends where the chart writes in
place), and of the ApiServerSource's resources; whitespace in the alert rules'
expressions; and lapse.yaml's text: both are read by lapse's own loader and must mean the
same.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from lapse.config.schema import LapseConfig
from tests.conftest import KubeStack
from tests.helm_chart import (
    ARGO_SERVED,
    CHART,
    CI_VALUES,
    generated_readme,
    run_helm,
    template,
    template_text,
)
from tests.infra_package import (
    OVERLAYS,
    install_crds,
    knative_crds,
    kubectl,
    prometheus_operator_crds,
    rendered_text,
    rendered_with_components,
    schema_of,
    unknown_fields,
)

HELM_LABELS = frozenset(
    {
        "helm.sh/chart",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
    }
)
HELM_ANNOTATIONS = ("helm.sh/", "checksum/")
KUSTOMIZE_HASH = re.compile(r"\b(lapse-nats-conf)-[a-z0-9]{10}\b")
UNORDERED = ("env", "volumes", "volumeMounts")
# What lapse.yaml says the chart sets from its own values, never from `config` (None: the
# whole section). `fleet` is not offered: a fleet leaf is lapse up's embedded NATS, and the
# chart's lapse always names a NATS of its own (docs/fleet.md, "Set up").
CHART_OWNED = {
    "nats": {"url", "user", "password", "password_file", "token", "token_file", "nkey_file",
             "creds_file", "tls"},
    "database": {"url"},
    "kubernetes": {"kubeconfig", "context", "in_cluster"},
    "ingress": {"token_file"},
    "policies": None,
    "kinds": None,
    "fleet": None,
}  # fmt: skip

Key = tuple[str, str, str, str]
# Every placement, identity, resources and extras value set (no overlay's settings).
EVERYTHING = CHART / "ci" / "everything-values.yaml"

# The Knative path's identities, which infra/base carries into the single-process overlay
# though nothing there uses them; the chart makes only what its shape runs.
KNATIVE_ONLY = {
    ("v1", "ServiceAccount", name)
    for name in ("lapse-apiserversource", "lapse-planner", "lapse-object-reaper",
                 "lapse-row-reaper", "lapse-bridge", "lapse-dlq-sink")
} | {
    ("rbac.authorization.k8s.io/v1", kind, "lapse-apiserversource-events")
    for kind in ("Role", "RoleBinding")
}  # fmt: skip
# infra/overlays/production/pdb.yaml names no namespace (kubectl puts its objects in the
# current one); the chart puts them in the release's.
NAMESPACE_UNSET = {("policy/v1", "PodDisruptionBudget")}


def key(doc: dict[str, Any]) -> Key:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])


def _clean_metadata(meta: dict[str, Any]) -> None:
    for field in ("labels", "annotations"):
        values = meta.get(field)
        if values is None:
            continue
        for name in list(values):
            if name in HELM_LABELS or name.startswith(HELM_ANNOTATIONS):
                del values[name]
        if not values:
            del meta[field]


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        if isinstance(value.get("metadata"), dict):
            _clean_metadata(value["metadata"])
        for name, item in value.items():
            value[name] = _normalize(item)
            if name in UNORDERED and isinstance(item, list):
                value[name] = sorted(item, key=lambda entry: str(entry.get("name")))
        return value
    if isinstance(value, list):
        return [_normalize(item) for item in value]
    return value


def normalized(doc: dict[str, Any]) -> dict[str, Any]:
    doc = _normalize(copy.deepcopy(doc))
    if doc["kind"] == "PrometheusRule":
        # kustomize's YAML library reads a folded `expr` with a more-indented line with one
        # newline more than YAML (and Helm) do; PromQL does not care about whitespace.
        for group in doc["spec"]["groups"]:
            for rule in group["rules"]:
                rule["expr"] = " ".join(rule["expr"].split())
    if doc["kind"] == "ApiServerSource":
        doc["spec"]["resources"].sort(key=lambda r: (r["apiVersion"], r["kind"]))
    if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "lapse":
        config = LapseConfig.model_validate(yaml.safe_load(doc["data"]["lapse.yaml"]))
        doc["data"]["lapse.yaml"] = config.model_dump(mode="json")
    return doc


def overlay_objects(overlay: str, text: str | None = None) -> dict[Key, dict[str, Any]]:
    text = KUSTOMIZE_HASH.sub(r"\1", text if text is not None else rendered_text(overlay))
    docs = [doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] != "Namespace"]
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in NAMESPACE_UNSET:
            doc["metadata"].setdefault("namespace", "lapse-system")
    if overlay == "single-process":
        docs = [
            d
            for d in docs
            if (d["apiVersion"], d["kind"], d["metadata"]["name"]) not in KNATIVE_ONLY
        ]
    return {key(doc): normalized(doc) for doc in docs}


def chart_objects(*args: str) -> dict[Key, dict[str, Any]]:
    return {key(doc): normalized(doc) for doc in template(*args)}


def _diff(expected: dict[str, Any], actual: dict[str, Any]) -> str:
    lines = difflib.unified_diff(
        yaml.safe_dump(expected, sort_keys=True).splitlines(),
        yaml.safe_dump(actual, sort_keys=True).splitlines(),
        "kustomize",
        "helm",
        lineterm="",
    )
    return "\n".join(lines)


def assert_same_objects(
    expected: dict[Key, dict[str, Any]], actual: dict[Key, dict[str, Any]]
) -> None:
    assert sorted(actual) == sorted(expected), (
        f"only in the overlay: {sorted(set(expected) - set(actual))}\n"
        f"only in the chart: {sorted(set(actual) - set(expected))}"
    )
    differ = {k: _diff(expected[k], actual[k]) for k in expected if expected[k] != actual[k]}
    assert not differ, "\n\n".join(f"{k}:\n{d}" for k, d in differ.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_chart_renders_what_the_overlay_renders(overlay: str) -> None:
    expected = overlay_objects(overlay)
    # lapse's CRDs are templates of the chart (crds.install, from files/crds: links to
    # infra/crds) and every overlay carries them: both shapes watch the policy objects.
    actual = chart_objects("--values", str(CI_VALUES[overlay]), *ARGO_SERVED)
    assert_same_objects(expected, actual)


def test_artifacts_enabled_renders_what_the_artifacts_component_adds(tmp_path: Path) -> None:
    """`artifacts.enabled` is infra/components/artifacts: dev with it, object for object."""
    docs = rendered_with_components("dev", ["artifacts"], tmp_path)
    expected = overlay_objects("dev", yaml.safe_dump_all(docs))
    actual = chart_objects(
        "--values",
        str(CI_VALUES["dev"]),
        *ARGO_SERVED,
        "--set",
        "artifacts.enabled=true",
    )
    assert ("serving.knative.dev/v1", "Service", "lapse-system", "lapse-artifact-reaper") in actual
    assert_same_objects(expected, actual)


def test_the_comparison_sees_a_difference() -> None:
    """The same comparison fails for a setting the overlay does not have."""
    expected = overlay_objects("dev")
    actual = chart_objects(
        "--values", str(CI_VALUES["dev"]), *ARGO_SERVED, "--set", "knative.bridge.replicas=3"
    )
    bridge = ("apps/v1", "Deployment", "lapse-system", "lapse-bridge")
    assert expected[bridge] != actual[bridge]
    assert actual[bridge]["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    "values", [None, *CI_VALUES.values(), EVERYTHING], ids=["defaults", *CI_VALUES, "everything"]
)
def test_helm_lint_strict_passes(values: Any) -> None:
    args = ["--values", str(values)] if values else []
    out = run_helm("lint", "--strict", str(CHART), *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout


def test_both_shapes_render_the_workloads_of_their_shape() -> None:
    def kinds(*args: str) -> set[tuple[str, str]]:
        return {(d["kind"], d["metadata"]["name"]) for d in template(*args)}

    knative = kinds("--set", "shape=knative")
    single = kinds("--set", "shape=singleProcess")
    assert {("Service", "lapse-ttl-planner"), ("Deployment", "lapse-bridge"),
            ("Broker", "lapse"), ("ApiServerSource", "lapse-workflows")} <= knative  # fmt: skip
    assert ("Deployment", "lapse") not in knative
    assert {("Deployment", "lapse"), ("ClusterRole", "lapse-watch")} <= single
    assert not {k for k in single if k[0] in ("Broker", "Trigger", "ApiServerSource")}
    # Both: the streams, lapse.yaml, the NATS the chart runs by default.
    for shape in (knative, single):
        assert {("Deployment", "lapse-streams"), ("ConfigMap", "lapse"),
                ("Deployment", "nats")} <= shape  # fmt: skip


def lapse_yaml(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lapse"]
    loaded: dict[str, Any] = yaml.safe_load(config["data"]["lapse.yaml"])
    return loaded


def test_each_setting_lands_everywhere_it_is_used(tmp_path: Path) -> None:
    """One value, several objects: the cleaned namespaces (RBAC, the ApiServerSource,
    lapse.yaml), a declared kind (its rights, its watch with its selector, lapse.yaml),
    the NATS URL and TLS (lapse.yaml, every pod's mounts), images with a digest, the
    OTel endpoint (every lapse container)."""
    volcano = {
        "name": "volcano-job", "api_version": "batch.volcano.sh/v1alpha1", "kind": "Job",
        "resource": "jobs", "finished_selector": "volcano.sh/finished=true",
        "finished": {"field": "status.state.phase", "phases": ["Completed", "Failed"]},
    }  # fmt: skip
    digest = "sha256:" + "a" * 64
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump({"namespaces": ["ml", "ci"], "kinds": ["argo-workflow", "job", volcano]})
    )
    docs = template(
        "--values", str(values), *ARGO_SERVED, "--api-versions", "batch.volcano.sh/v1alpha1/Job",
        "--set", "nats.url=tls://nats.example:4222,nats.tls.enabled=true",
        "--set", "nats.tls.clientCertificate=true,nats.server.enabled=false",
        "--set", f"images.ttlPlanner.digest={digest},images.registry=registry.example.com",
        "--set", "otel.endpoint=http://collector.observability:4318",
        namespace="lapse-helm",
    )  # fmt: skip
    config = lapse_yaml(docs)
    LapseConfig.model_validate(config)
    assert config["safety"]["namespaces"]["include"] == ["ml", "ci"]
    (urls,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lapse"]
    assert urls["data"]["nats-url"] == "tls://nats.example:4222"
    (telemetry,) = [d for d in docs if d["metadata"]["name"] == "lapse-telemetry"]
    assert telemetry["data"] == {
        "LAPSE_PROMETHEUS_PORT": "9464",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.observability:4318",
    }
    assert config["nats"]["tls"] == {
        "ca_file": "/etc/lapse-nats-tls/ca.crt",
        "cert_file": "/etc/lapse-nats-tls/tls.crt",
        "key_file": "/etc/lapse-nats-tls/tls.key",
    }
    assert config["kinds"][-1]["name"] == "volcano-job"
    (source,) = [d for d in docs if d["kind"] == "ApiServerSource"]
    assert source["spec"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml", "ci"]
    assert source["spec"]["resources"] == [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
         "selector": {"matchLabels": {"workflows.argoproj.io/completed": "true"}}},
        {"apiVersion": "batch/v1", "kind": "Job"},
        {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
         "selector": {"matchLabels": {"volcano.sh/finished": "true"}}},
    ]  # fmt: skip
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] in ("ml", "ci")]
    assert {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in roles} == {
        (ns, name) for ns in ("ml", "ci") for name in ("lapse-object-reaper", "lapse-reader")
    }
    for role in roles:
        assert {"apiGroups": ["batch.volcano.sh"], "resources": ["jobs"]} in [
            {k: rule[k] for k in ("apiGroups", "resources")} for rule in role["rules"]
        ]
    assert not [d for d in docs if d["metadata"]["name"] == "nats"]
    pods = [d for d in docs if d["kind"] in ("Deployment", "Service") and "template" in d["spec"]]
    # 3 functions, the bridge, the dead-letter sink, the streams, the policy watcher
    assert len(pods) == 7
    for pod in pods:
        spec = pod["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert container["envFrom"] == [{"configMapRef": {"name": "lapse-telemetry"}}]
        assert "LAPSE_NATS__URL" in env
        assert {"name": "nats-tls", "mountPath": "/etc/lapse-nats-tls", "readOnly": True} in (
            container["volumeMounts"]
        )
        assert container["image"].startswith("registry.example.com/lapse/")
        if pod["metadata"]["name"] == "lapse-ttl-planner":
            assert container["image"] == f"registry.example.com/lapse/ttl-planner:0.2.0@{digest}"
            assert env["LAPSE_SENDER_AUDIENCE"] == (
                "serving.knative.dev/service/lapse-helm/lapse-ttl-planner"
            )
    # Cluster-scoped names carry the namespace outside lapse-system.
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"} == {
        f"lapse-helm-{name}"
        for name in ("lapse-tokenreview", "lapse-policy-editor", "lapse-policy-reader",
                     "lapse-policy-follower")
    }  # fmt: skip
    # ... and the bindings name them so.
    for binding in [d for d in docs if d["kind"] == "ClusterRoleBinding"]:
        assert binding["roleRef"]["name"] == binding["metadata"]["name"], binding
        assert binding["metadata"]["name"].startswith("lapse-helm-"), binding


def test_triggers_are_the_routing_table_with_their_delivery() -> None:
    """files/triggers.yaml is infra/knative/triggers.yaml (the one routing table), each
    Trigger with the delivery of infra/knative/delivery.yaml and its audience in the
    release's namespace."""
    source = [d for d in yaml.safe_load_all((CHART / "files/triggers.yaml").read_text()) if d]
    triggers = [d for d in template(namespace="elsewhere") if d["kind"] == "Trigger"]
    assert [t["metadata"]["name"] for t in triggers] == [s["metadata"]["name"] for s in source]
    for trigger in triggers:
        spec = trigger["spec"]
        assert spec["delivery"]["retry"] == 200
        assert spec["subscriber"]["audience"].startswith("serving.knative.dev/service/elsewhere/")
        assert "annotations" not in trigger["metadata"]


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        (["--set", "bogus=1"], "additional properties 'bogus' not allowed"),
        (["--set", "shape=kubernetes"], "/shape"),
        (["--set", "config.nats.url=nats://x:4222"], "additional properties 'url' not allowed"),
        (["--set", "config.safety.namespaces.include={a}"], "'include' not allowed"),
        (["--set", "config.nats.replicas=seven"], "/config/nats/replicas"),
        (["--set", "config.nats.replicas=9"], "/config/nats/replicas"),
        (["--set", "config.nats.audit_max_age=a week"], "/config/nats/audit_max_age"),
        (["--set-json", "namespaces=[]"], "/namespaces"),
        (["--set-json", 'namespaces=["Team_A"]'], "/namespaces/0"),
        (["--set-json", 'kinds=["argo"]'], "/kinds/0"),
        (["--set-json", 'policies=[{"name":"x","kubernetes":{"tll":"1h"}}]'], "'tll' not allowed"),
        (["--set", "images.lapse.digest=latest"], "/images/lapse/digest"),
        (["--set", "knative.bridge.replicas=two"], "/knative/bridge/replicas"),
        (["--set", "metrics.podMonitor.enable=true"], "'enable' not allowed"),
        (["--set", "otel.env.PATH=/tmp"], "'PATH' does not match pattern"),
    ],
)
def test_the_schema_refuses(values: list[str], refusal: str) -> None:
    out = run_helm("template", "lapse", str(CHART), *values, check=False)
    assert out.returncode != 0
    assert "don't meet the specifications of the schema" in out.stderr, out.stderr
    assert refusal in out.stderr, out.stderr


# A typo in each block of placement, identity, resources and extras, and in the CRD switches:
# helm reports every schema error of one run, so one run shows each is refused.
TYPOS = {
    "nodeSelectr": "additional properties 'nodeSelectr' not allowed",
    "affinity.nodeAfinity": "at '/affinity': additional properties 'nodeAfinity' not allowed",
    "crds.instal": "at '/crds': additional properties 'instal' not allowed",
    "defaultResources.brige": "at '/defaultResources': additional properties 'brige' not allowed",
    "nats.server.tolerationz": "at '/nats/server': additional properties 'tolerationz' not allowed",
    "components.reaper": "at '/components': additional properties 'reaper' not allowed",
    "components.bridge.podLabel": "at '/components/bridge': additional properties 'podLabel'",
    "components.artifactReaper.serviceAccount.annotation": (
        "at '/components/artifactReaper/serviceAccount': additional properties 'annotation'"
    ),
    "components.lapseUp.resources.request": (
        "at '/components/lapseUp/resources': additional properties 'request' not allowed"
    ),
}


def test_the_schema_refuses_a_typo_in_each_new_block() -> None:
    typos = [f"{path}=x" for path in TYPOS]
    wrong_type = ["extraEnv[0].value=no-name", "components.streams.priorityClassName=1"]
    args = [arg for typo in typos + wrong_type for arg in ("--set", typo)]
    out = run_helm("template", "lapse", str(CHART), *args, check=False)
    assert out.returncode != 0
    for refusal in TYPOS.values():
        assert refusal in out.stderr, out.stderr
    assert "at '/extraEnv/0': missing property 'name'" in out.stderr, out.stderr
    assert "at '/components/streams/priorityClassName'" in out.stderr, out.stderr
    lint = run_helm("lint", "--strict", str(CHART), "--set", typos[0], check=False)
    assert lint.returncode != 0
    assert TYPOS["nodeSelectr"] in lint.stdout + lint.stderr


def test_crds_are_templates_installed_and_kept_by_switches() -> None:
    """crds.install renders lapse's CRDs (infra/crds, byte for byte but Helm's labels and
    annotations: the overlay comparison checks that) with `helm.sh/resource-policy: keep`
    unless crds.keep is false; crds.install false renders none. Nothing is left in crds/,
    which Helm would install once and never upgrade."""
    assert not (CHART / "crds").exists()
    for link in (CHART / "files" / "crds").iterdir():
        assert link.resolve().parent == (CHART.parents[1] / "infra" / "crds").resolve(), link

    def crds(*args: str) -> list[dict[str, Any]]:
        return [d for d in template(*args) if d["kind"] == "CustomResourceDefinition"]

    kept = crds()
    assert sorted(c["metadata"]["name"] for c in kept) == [
        "clusterlapsepolicies.lapse.dev", "lapsepolicies.lapse.dev"
    ]  # fmt: skip
    assert {c["metadata"]["annotations"]["helm.sh/resource-policy"] for c in kept} == {"keep"}
    unkept = crds("--set", "crds.keep=false,shape=singleProcess")
    assert len(unkept) == 2
    assert not [c for c in unkept if "annotations" in c["metadata"]]
    assert crds("--set", "crds.install=false") == []


def test_the_charts_readme_is_what_helm_docs_generates_from_the_values() -> None:
    """charts/lapse/README.md: regenerate with `"$(bash scripts/build-helm-docs.sh)" -c
    charts -s file` after changing values.yaml or README.md.gotmpl."""
    readme = (CHART / "README.md").read_text()
    assert readme == generated_readme(), "charts/lapse/README.md is stale: regenerate it"
    assert "| components.artifactReaper | object | `{}` |" in readme
    assert "| crds.keep | bool | `true` |" in readme


def test_nats_url_is_required_without_the_charts_nats() -> None:
    out = run_helm("template", "lapse", str(CHART), "--set", "nats.server.enabled=false",
                   check=False)  # fmt: skip
    assert out.returncode != 0
    assert "nats.url is required" in out.stderr


def test_config_in_the_schema_is_lapse_yaml_without_what_the_chart_sets() -> None:
    """values.schema.json's `config` names every key of lapse.yaml (lapse/config/schema.py)
    except what the chart sets from its own values, so a new lapse.yaml key is not
    silently refused by the chart, and a key the chart owns cannot be set twice."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]
    sections = schema["properties"]
    for section, field in LapseConfig.model_fields.items():
        owned = CHART_OWNED.get(section, set())
        if owned is None:
            assert section not in sections, section
            continue
        model = field.annotation
        assert isinstance(model, type), section
        expected = set(model.model_fields) - owned
        assert set(sections[section]["properties"]) == expected, section


def test_the_defaults_configure_a_lapse_that_loads() -> None:
    for shape in ("knative", "singleProcess"):
        LapseConfig.model_validate(lapse_yaml(template("--set", f"shape={shape}")))


def test_security_context_defaults_are_restricted() -> None:
    """Pod Security Standards `restricted`: every container non-root, no privilege
    escalation, every capability dropped, the runtime's seccomp profile."""
    for shape in ("knative", "singleProcess"):
        for doc in template("--set", f"shape={shape}"):
            spec = doc.get("spec", {}).get("template", {}).get("spec")
            if not spec:
                continue
            for container in spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False, doc["metadata"]["name"]
                assert context["capabilities"] == {"drop": ["ALL"]}
                assert context["runAsNonRoot"] is True
                assert context["seccompProfile"] == {"type": "RuntimeDefault"}
                assert context["readOnlyRootFilesystem"] is True
                assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_the_rendered_text_names_no_other_namespace() -> None:
    """Installed elsewhere, nothing points at lapse-system (audiences, subjects, URLs)."""
    assert "lapse-system" not in template_text(namespace="lapse-helm")
    assert "lapse-system" not in template_text("--set", "shape=singleProcess",
                                               namespace="lapse-helm")  # fmt: skip


def full_render(tmp_path: Path, shape: str = "knative") -> str:
    """A shape with most values away from their defaults (and every placement, identity,
    resources and extras value: ci/everything-values.yaml), in another namespace."""
    values = tmp_path / "full.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "shape": shape,
                "namespaces": ["ml", "ci"],
                "nats": {"url": "tls://nats.nats.svc:4222",
                         "server": {"enabled": shape == "singleProcess",
                                    "persistence": {"enabled": True, "size": "2Gi"}},
                         "tls": {"enabled": True, "clientCertificate": True}},
                "images": {"registry": "registry.example.com", "pullPolicy": "IfNotPresent"},
                "imagePullSecrets": [{"name": "pull"}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "knative": {"functions": {"maxScale": 5,
                                          "annotations": {"autoscaling.knative.dev/window": "6s"}},
                            "bridge": {"replicas": 2}, "podDisruptionBudgets": True},
                "otel": {"endpoint": "http://collector:4318",
                         "env": {"OTEL_BSP_SCHEDULE_DELAY": 500}},
                "metrics": {"port": 9100, "podMonitor": {"enabled": True, "interval": "30s"},
                            "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                            "grafanaDashboard": {"enabled": True}},
            }
        )
    )  # fmt: skip
    return template_text("--values", str(EVERYTHING), "--values", str(values),
                         namespace="lapse-helm")  # fmt: skip


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each workload's pod template: (metadata, spec), by the workload's name."""
    return {
        d["metadata"]["name"]: (d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in ("Deployment", "Service", "Job") and "template" in d.get("spec", {})
    }


def assert_everything_landed(docs: list[dict[str, Any]], shape: str) -> None:
    """Each value of ci/everything-values.yaml where it belongs: a component's own value
    replaces the chart-wide one, pod labels and annotations merge, extras add up."""
    everything = yaml.safe_load(EVERYTHING.read_text())
    components = everything["components"]
    names = {
        "knative": {"lapse-ttl-planner": "ttlPlanner", "lapse-object-reaper": "objectReaper",
                    "lapse-row-reaper": "rowReaper", "lapse-artifact-reaper": "artifactReaper",
                    "lapse-bridge": "bridge", "lapse-dlq-sink": "dlqSink",
                    "lapse-policy-watcher": "policyWatcher", "lapse-streams": "streams"},
        "singleProcess": {"lapse": "lapseUp", "lapse-streams": "streams",
                          "lapse-nats-users": "natsUsers", "nats": None},
    }[shape]  # fmt: skip
    pods = pod_specs(docs)
    assert set(pods) == set(names)
    for name, key in names.items():
        meta, spec = pods[name]
        own = everything["nats"]["server"] if key is None else components[key]
        for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
            assert spec[field] == (own.get(field) or everything[field]), (name, field)
        # A spread constraint without a selector spreads the pod's own kind.
        selector = {"matchLabels": {"app.kubernetes.io/name": name}}
        if name in ("lapse-ttl-planner", "lapse-object-reaper", "lapse-row-reaper",
                    "lapse-artifact-reaper"):  # fmt: skip
            selector = {"matchLabels": {"serving.knative.dev/service": name}}
        spread = own.get("topologySpreadConstraints") or everything["topologySpreadConstraints"]
        assert spec["topologySpreadConstraints"] == [
            {"labelSelector": selector, **constraint} for constraint in spread
        ], name
        assert everything["podLabels"].items() | own.get("podLabels", {}).items() <= (
            meta["labels"].items()
        ), name
        annotations = {**everything["podAnnotations"], **own.get("podAnnotations", {})}
        assert annotations.items() <= meta["annotations"].items(), name
        if key is None:
            continue
        (container,) = spec["containers"]
        env = [e for e in container["env"] if e["name"] in ("HTTPS_PROXY", "AWS_REGION",
                                                             "STORE_TOKEN")]  # fmt: skip
        assert env == everything["extraEnv"] + own.get("extraEnv", []), name
        assert everything["extraVolumes"][0] in spec["volumes"], name
        for volume in own.get("extraVolumes", []):
            assert volume in spec["volumes"], name
        for mount in everything["extraVolumeMounts"] + own.get("extraVolumeMounts", []):
            assert mount in container["volumeMounts"], name
        # Own resources, else the chart-wide ones the full render sets.
        assert container["resources"] == own.get("resources", {"requests": {"cpu": "100m",
                                                  "memory": "128Mi"}}), name  # fmt: skip
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    if shape == "knative":
        identity = components["artifactReaper"]["serviceAccount"]["annotations"]
        assert accounts["lapse-artifact-reaper"]["metadata"]["annotations"] == identity
        assert pods["lapse-row-reaper"][1]["serviceAccountName"] == "platform-row-reaper"
        assert "platform-row-reaper" not in accounts and "lapse-row-reaper" not in accounts
        assert pods["lapse-bridge"][1]["serviceAccountName"] == "lapse-bridge-irsa"
        assert "lapse-bridge-irsa" in accounts
        (policy,) = [d for d in docs if d["kind"] == "EventPolicy"]
        bridge = {"sub": "system:serviceaccount:lapse-helm:lapse-bridge-irsa"}
        assert bridge in policy["spec"]["from"]
        subjects = [s["name"] for d in docs if d["kind"].endswith("RoleBinding")
                    for s in d.get("subjects", [])]  # fmt: skip
        assert "platform-row-reaper" in subjects and "lapse-row-reaper" not in subjects
    else:
        identity = components["lapseUp"]["serviceAccount"]["annotations"]
        assert accounts["lapse"]["metadata"]["annotations"] == identity
        assert accounts["lapse-nats-users"]["metadata"]["annotations"][
            "example.com/purpose"] == "nats-passwords"  # fmt: skip


def label_restricted(kube: KubeStack, namespace: str) -> None:
    """Pod Security `restricted`, enforced and warned about (a workload's pod template is
    only warned about: enforcement applies to pods)."""
    core = client.CoreV1Api(kube.api_client)
    labels = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}
    core.patch_namespace(namespace, {"metadata": {"labels": labels}})


def server_dry_run(kube: KubeStack, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(kubectl()), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side",
            "--field-manager=lapse-test", "--dry-run=server", "--validate=strict", "-f", "-",
        ],
        input=text, capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.kube
@pytest.mark.parametrize("shape", ["knative", "singleProcess"])
def test_a_full_render_passes_a_strict_server_side_dry_run(
    kube: KubeStack, tmp_path: Path, shape: str
) -> None:
    """Every value set (ci/everything-values.yaml and more), into namespaces that enforce
    Pod Security `restricted`: the API server takes every object, without a warning."""
    install_crds(kube.api_client, knative_crds() + prometheus_operator_crds())
    text = full_render(tmp_path, shape)
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert_everything_landed(docs, shape)
    for namespace in {d["metadata"].get("namespace") for d in docs} - {None}:
        label_restricted(kube, kube.namespace(namespace))
    out = server_dry_run(kube, text)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), out.stdout
    if shape == "singleProcess":
        # The namespace's label bites: the same Deployment as root is warned about.
        (up,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lapse"]
        up["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] = False
        out = server_dry_run(kube, yaml.safe_dump(up))
        assert 'would violate PodSecurity "restricted:latest"' in out.stderr, out.stderr


def test_knative_objects_of_a_full_render_declare_only_schema_fields(tmp_path: Path) -> None:
    crds = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in knative_crds()}
    checked = 0
    for doc in yaml.safe_load_all(full_render(tmp_path)):
        group, _, version = doc["apiVersion"].rpartition("/")
        if (group, doc["kind"]) in crds:
            schema = schema_of(crds[(group, doc["kind"])], version)
            assert unknown_fields(doc, schema) == [], f"{doc['kind']} {doc['metadata']['name']}"
            checked += 1
    assert checked >= 10  # Broker, 4 Triggers, ApiServerSource, SinkBinding, 3 Services


def test_the_source_watches_only_the_kinds_the_cluster_serves() -> None:
    """Knative's adapter sends nothing at all once one kind is unknown to the API server:
    the ApiServerSource lists only the kinds of `kinds` the cluster serves (Helm's
    capabilities; `helm template` knows only the built-in APIs unless told), while
    lapse.yaml keeps every kind (lapse looks for a missing CRD again by itself)."""

    def watched(*args: str) -> list[str]:
        docs = template(*args)
        (source,) = [d for d in docs if d["kind"] == "ApiServerSource"]
        assert lapse_yaml(docs)["kinds"] == [
            "argo-workflow", "tekton-pipelinerun", "tekton-taskrun", "job", "trainjob"
        ]  # fmt: skip
        return [r["kind"] for r in source["spec"]["resources"]]

    assert watched() == ["Job"]
    assert watched("--api-versions", "tekton.dev/v1") == ["PipelineRun", "TaskRun", "Job"]
    assert watched(*ARGO_SERVED, "--api-versions", "trainer.kubeflow.org/v1alpha1") == [
        "Workflow", "Job", "TrainJob"
    ]  # fmt: skip
