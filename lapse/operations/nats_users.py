"""Create the Secret holding a random NATS password per lapse identity, if there is none.

Run by the Job `lapse-nats-users` of the dev NATS (infra/dev-nats): no password is ever
committed or typed, each is generated in the cluster, and a Secret that exists is never
changed (a rerun, an upgrade, or passwords an operator put there keep working). The NATS
pod and every lapse pod wait for the Secret, then each component reads only its own key.

    python -m lapse.operations.nats_users [--namespace NS] [--secret NAME]
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

from kubernetes import client

from lapse.edges.kubernetes import load_api_client
from lapse.embedded.nats_identities import KUBERNETES, USERS_SECRET, new_password

POD_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def users_secret(name: str, namespace: str) -> client.V1Secret:
    """A new Secret: one key per identity (its NATS user name), a random password each."""
    data = {
        identity.user: base64.b64encode(new_password().encode()).decode() for identity in KUBERNETES
    }
    return client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            labels={"app.kubernetes.io/part-of": "lapse"},
        ),
        type="Opaque",
        data=data,
    )


def ensure(api: client.CoreV1Api, name: str, namespace: str) -> bool:
    """Create the Secret unless it exists; True when it was created now."""
    try:
        api.create_namespaced_secret(namespace, users_secret(name, namespace))
    except client.exceptions.ApiException as exc:
        if exc.status == 409:  # there already: never replaced
            return False
        raise
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lapse.operations.nats_users")
    parser.add_argument("--namespace", help="default: the pod's own namespace")
    parser.add_argument("--secret", default=USERS_SECRET)
    args = parser.parse_args(argv)
    namespace = args.namespace or POD_NAMESPACE.read_text(encoding="utf-8").strip()
    api = client.CoreV1Api(load_api_client())
    created = ensure(api, args.secret, namespace)
    # Never the passwords: only what was done.
    print(f"secret {namespace}/{args.secret} {'created' if created else 'kept (exists)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
