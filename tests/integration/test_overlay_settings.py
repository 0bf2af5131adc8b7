"""Each setting once per overlay (infra/overlays/*): the NATS URL is the ConfigMap's
nats-url, which every lapse process takes (infra/components/lapse-pods); the image registry
and tag are lapse/lapse's `images:` entry, from which the functions' images are derived
(the overlay's replacements). Changing one line changes every pod. And the run kinds the
ApiServerSource watches are chosen by engine, one Component each."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lapse.events.kinds import BUILTIN_KINDS
from tests.infra_package import INFRA, OVERLAYS, kubectl, rendered

BUILTIN_KINDS_BY_GVK = {(k.api_version, k.kind): k for k in BUILTIN_KINDS.values()}
NATS_URL = re.compile(r"\b(?:nats|tls)://[\w.-]+:\d+")


def images(overlay: str) -> set[str]:
    found = set()
    for doc in rendered(overlay):
        spec: dict[str, Any] = doc.get("spec", {}).get("template", {}).get("spec", {})
        found |= {c["image"] for c in spec.get("containers", [])}
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_nats_url_is_written_once(overlay: str) -> None:
    folder = INFRA / "overlays" / overlay
    written = [
        (path.name, url)
        for path in sorted(folder.rglob("*.yaml"))
        for url in NATS_URL.findall(
            "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        )
    ]
    # The dev overlays keep base's nats-url (the dev NATS); production sets its own, once.
    assert len(written) == (1 if overlay == "production" else 0), written
    (config,) = [
        d
        for d in rendered(overlay)
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lapse"
    ]
    assert NATS_URL.fullmatch(config["data"]["nats-url"])
    assert "url" not in (yaml.safe_load(config["data"]["lapse.yaml"])["nats"] or {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_registry_and_tag_are_written_once(overlay: str) -> None:
    kustomization = yaml.safe_load(
        (INFRA / "overlays" / overlay / "kustomization.yaml").read_text()
    )
    (entry,) = kustomization["images"]
    assert entry["name"] == "lapse/lapse"
    where, tag = entry["newName"].removesuffix("/lapse"), entry["newTag"]
    used = images(overlay)
    assert f"{where}/lapse:{tag}" in used
    # Every image, the functions' included, is beside it with its tag: none left unset.
    for image in used:
        assert image.startswith(f"{where}/") and image.endswith(f":{tag}"), image
    if overlay != "single-process":
        functions = {f"{where}/{name}:{tag}" for name in ("ttl-planner", "object-reaper",
                                                          "row-reaper")}  # fmt: skip
        assert functions <= used


def source_kinds(kustomization: dict[str, Any], folder: Path) -> set[tuple[str, str]]:
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(folder)], capture_output=True, text=True, check=True
    )
    (source,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ApiServerSource"]
    return {(r["apiVersion"], r["kind"]) for r in source["spec"]["resources"]}


def test_one_component_per_engine_adds_exactly_its_kinds(tmp_path: Path) -> None:
    """infra/components/kinds/<engine>: together with Jobs (always watched) they cover every
    kind lapse knows (events/kinds.py), each only its engine's, so an overlay watches only
    kinds whose CRDs the cluster serves."""
    knative = os.path.relpath(INFRA / "knative", tmp_path)
    components = sorted((INFRA / "components" / "kinds").iterdir())
    base = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [knative]}  # fmt: skip
    job = ("batch/v1", "Job")
    assert source_kinds(base, tmp_path) == {job}
    covered = {job}
    for component in components:
        kinds = source_kinds(
            {**base, "components": [os.path.relpath(component, tmp_path)]}, tmp_path
        ) - {job}
        engines = {BUILTIN_KINDS_BY_GVK[k].engine for k in kinds}
        assert len(engines) == 1 and kinds, (component.name, kinds)
        assert not kinds & covered, component.name
        covered |= kinds
    assert covered == set(BUILTIN_KINDS_BY_GVK)
