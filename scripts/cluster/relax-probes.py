"""Print, for every Deployment in the JSON list on stdin, a server-side-apply patch that
gives its containers' probes room on a loaded 2-core node.

Knative's controllers and dispatchers probe every 1-2 s with a 1 s timeout and 3 failures:
while the test suite saturates both cores a probe misses its second, the kubelet restarts
the in-memory channel's controller (its webhook then refuses the Subscriptions it must
admit) and a restarted dispatcher loses what it held (docs/deploy.md, "Retries"). Those
restarts are the machine's, not lapse's: the test cluster gives every probe 5 s and
liveness 10 failures, and keeps the period. Standard library only.

usage: kubectl get deploy -o json | relax-probes.py > patches.json
"""

import json
import sys

TIMEOUT = 5
LIVENESS_FAILURES = 10


def relaxed(probe: dict[str, object], *, liveness: bool) -> dict[str, object]:
    out = dict(probe)
    out["timeoutSeconds"] = max(int(str(probe.get("timeoutSeconds", 1))), TIMEOUT)
    if liveness:
        failures = int(str(probe.get("failureThreshold", 3)))
        out["failureThreshold"] = max(failures, LIVENESS_FAILURES)
    return out


def main() -> int:
    items = []
    for deploy in json.load(sys.stdin)["items"]:
        containers = []
        for c in deploy["spec"]["template"]["spec"]["containers"]:
            patch: dict[str, object] = {"name": c["name"]}
            if "livenessProbe" in c:
                patch["livenessProbe"] = relaxed(c["livenessProbe"], liveness=True)
            if "readinessProbe" in c:
                patch["readinessProbe"] = relaxed(c["readinessProbe"], liveness=False)
            if len(patch) > 1:
                containers.append(patch)
        if containers:
            meta = deploy["metadata"]
            items.append(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                    # The selector only because client-side validation wants it (same value).
                    "spec": {
                        "selector": deploy["spec"]["selector"],
                        "template": {"spec": {"containers": containers}},
                    },
                }
            )
    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
