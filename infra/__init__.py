"""What gets deployed: NATS streams, Knative services and triggers, RBAC, OpenTelemetry.

A package only so these files ship inside the wheel: the local runner reads the same
definitions the cluster uses (`lapse.infra.read_text("nats/streams.yaml")`).
"""

from importlib import resources


def read_text(relative_path: str) -> str:
    return resources.files(__name__).joinpath(relative_path).read_text()
