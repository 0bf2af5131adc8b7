"""Print infra/dev-nats/nats.conf: the Kubernetes identities with the durable consumers each
owns (lapse/embedded/nats_identities.py, lapse/runtime/consumers.py).

    python -m lapse.operations.nats_conf > infra/dev-nats/nats.conf
"""

from __future__ import annotations

from lapse.embedded.nats_identities import kubernetes_conf
from lapse.runtime.consumers import owned_durables, retired_durables


def main() -> int:
    print(kubernetes_conf(owned_durables(), retired_durables()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
