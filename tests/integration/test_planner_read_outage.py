"""The planner's read of a claimed object when the API server does not answer: a real
refusal, from a loopback port nothing listens on. The read is delivered again later
(`RetryLater`), so the claim is neither believed nor refused, and an outage is never what
dead-letters it (the dispatcher dead-letters other failures after `nats.max_deliver`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lapse.config import LapseConfig
from lapse.config.schema import KubernetesConfig
from lapse.embedded.process import free_port
from lapse.events.kinds import ARGO_WORKFLOW
from lapse.functions.ports import RetryLater
from lapse.runtime.factories.ttl_planner import ReferencedObjects
from lapse.runtime.resources import Resources


def _refused_kubeconfig(folder: Path) -> Path:
    server = f"https://127.0.0.1:{free_port()}"  # refused: nothing listens there
    path = folder / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


async def test_a_claimed_object_read_during_an_outage_is_delivered_again(
    tmp_path: Path,
) -> None:
    """The claimed object's read and a keep_last group's list (the object reaper's lister,
    lapse/edges/kubernetes/reaping.py) both wait an outage out."""
    config = LapseConfig(kubernetes=KubernetesConfig(kubeconfig=_refused_kubeconfig(tmp_path)))
    async with Resources(config) as resources:
        objects = ReferencedObjects(resources)
        with pytest.raises(RetryLater) as waited:
            await objects.fetch("argoproj.io/v1alpha1", "Workflow", "team-a", "wf-1")
        with pytest.raises(RetryLater) as listed:
            await objects.list_items(ARGO_WORKFLOW, "team-a", label_selector="team=a")
    assert "cannot read Workflow team-a/wf-1 yet" in waited.value.reason
    assert waited.value.delay > 0
    assert "cannot list Workflow team-a/team=a yet" in listed.value.reason
    assert listed.value.delay > 0
