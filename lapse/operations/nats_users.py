"""Create the Secret holding a random NATS password per lapse identity, if there is none.

Run by the Job `lapse-nats-users` of the dev NATS (infra/dev-nats): no password is ever
committed or typed, each is generated in the cluster, and a password that exists is never
changed (a rerun, an upgrade, or passwords an operator put there keep working); an upgrade
that brings a new identity gets its key added. The NATS
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


def _password() -> str:
    return base64.b64encode(new_password().encode()).decode()


def users_secret(name: str, namespace: str) -> client.V1Secret:
    """A new Secret: one key per identity (its NATS user name), a random password each."""
    return client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            labels={"app.kubernetes.io/part-of": "lapse"},
        ),
        type="Opaque",
        data={identity.user: _password() for identity in KUBERNETES},
    )


def ensure(api: client.CoreV1Api, name: str, namespace: str) -> str:
    """Create the Secret, or add the keys of identities it lacks (an upgrade brought a new
    component) without changing one that is there. Says what was done: `created`,
    `added <users>` or `kept`."""
    try:
        api.create_namespaced_secret(namespace, users_secret(name, namespace))
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    else:
        return "created"
    existing = api.read_namespaced_secret(name, namespace)
    missing = sorted({i.user for i in KUBERNETES} - set(existing.data or {}))
    if not missing:
        return "kept"
    # Held to the version read: a concurrent writer makes this fail (409) rather than lose
    # its keys; the Job is retried and reads again.
    api.patch_namespaced_secret(
        name,
        namespace,
        {
            "metadata": {"resourceVersion": existing.metadata.resource_version},
            "data": {user: _password() for user in missing},
        },
    )
    return "added " + ", ".join(missing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lapse.operations.nats_users")
    parser.add_argument("--namespace", help="default: the pod's own namespace")
    parser.add_argument("--secret", default=USERS_SECRET)
    args = parser.parse_args(argv)
    namespace = args.namespace or POD_NAMESPACE.read_text(encoding="utf-8").strip()
    api = client.CoreV1Api(load_api_client())
    done = ensure(api, args.secret, namespace)
    # Never the passwords: only what was done.
    print(f"secret {namespace}/{args.secret} {done}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
