"""lapse's own objects: `LapsePolicy` and `ClusterLapsePolicy` (infra/crds/,
functions/policy_objects.py). Read and watched like run kinds (KubeObjects takes a
KindSpec); lapse writes only their status subresource."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from kubernetes.client.exceptions import ApiException

# Where it was first defined: still importable from here.
from lapse.edges.kubernetes.namespaces import namespace_names as namespace_names
from lapse.edges.kubernetes.objects import KubeObjects, finished_pages
from lapse.events.kinds import KindSpec
from lapse.events.timeutil import format_rfc3339
from lapse.functions.policy import Policy
from lapse.functions.policy_objects import (
    ACCEPTED,
    API_VERSION,
    CLUSTER_LAPSE_POLICY,
    LAPSE_POLICY,
    Verdict,
    effective,
)


def _spec(name: str, kind: str, resource: str) -> KindSpec:
    # A KindSpec names the API path; `finished` is required by the model and never read.
    return KindSpec(
        name=name, api_version=API_VERSION, kind=kind, resource=resource,
        finished={"phases": ["-"]},
    )  # fmt: skip


LAPSE_POLICIES: Final = _spec("lapse-policy", LAPSE_POLICY, "lapsepolicies")
CLUSTER_LAPSE_POLICIES: Final = _spec(
    "cluster-lapse-policy", CLUSTER_LAPSE_POLICY, "clusterlapsepolicies"
)


def status_of(verdict: Verdict, current: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
    """The status lapse writes for `verdict`; the transition time moves only when the
    condition's status does (the Kubernetes convention)."""
    status = "True" if verdict.accepted else "False"
    previous = next(
        (c for c in (current or {}).get("conditions") or [] if c.get("type") == ACCEPTED), None
    )
    since = (
        previous["lastTransitionTime"]
        if previous and previous.get("status") == status and previous.get("lastTransitionTime")
        else format_rfc3339(now.astimezone(UTC))
    )
    return {
        "observedGeneration": verdict.ref.generation,
        "policy": verdict.ref.label,
        "conditions": [
            {
                "type": ACCEPTED,
                "status": status,
                "reason": verdict.reason,
                "message": verdict.message[:32768],
                "observedGeneration": verdict.ref.generation,
                "lastTransitionTime": since,
            }
        ],
    }


def says(current: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    """Whether the object's status already says what `wanted` does (nothing to write)."""
    if not current or current.get("observedGeneration") != wanted["observedGeneration"]:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    have = [
        {k: c.get(k) for k in keys}
        for c in current.get("conditions") or []
        if c.get("type") == ACCEPTED
    ]
    return have == [{k: wanted["conditions"][0][k] for k in keys}]


async def read_policy_objects(
    objects: KubeObjects,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(LapsePolicies, ClusterLapsePolicies, notes) as they are now, for a one-off reader
    (`lapse plan`); a CRD not installed or not readable is a note, not an error."""
    found: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    for spec in (LAPSE_POLICIES, CLUSTER_LAPSE_POLICIES):
        found[spec.kind] = []
        try:
            async for page in finished_pages(objects, spec):
                found[spec.kind] += [{"kind": spec.kind, **item} for item in page.items]
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            why = "not installed" if exc.status == 404 else "not readable"
            notes.append(f"{spec.describe()} is {why}: only lapse.yaml's policies are used")
    return found[LAPSE_POLICY], found[CLUSTER_LAPSE_POLICY], notes


async def policies_in_effect(
    objects: KubeObjects, configured: Sequence[Policy]
) -> tuple[Policy, ...]:
    """The policy list `lapse up` plans with now (lapse.yaml's and the policy objects'),
    for a one-off pass that must decide the same (`lapse reconcile`)."""
    namespaced, clusters, _ = await read_policy_objects(objects)
    return effective(namespaced, clusters, configured).policies
