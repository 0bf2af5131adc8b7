"""The API server's own account of lapse's DELETEs: a kube-apiserver with an audit log of
every Workflow DELETE, read with bench's parser. Fault tests count deletions here rather
than trusting lapse's audit stream, which drops a second outcome for the same due event."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from bench.report import Request, parse_audit_line
from tests.conftest import KubeStack, kube_stack

# Every request with these verbs on a Workflow, at Metadata level: who, which object, the
# answer, and when the server received and finished it.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: Metadata
    verbs: {verbs}
    resources: [{{group: argoproj.io, resources: [workflows]}}]
  - level: None
"""


@contextlib.contextmanager
def audited_kube_stack(
    work_dir: Path, *extra_args: str, verbs: tuple[str, ...] = ("delete",)
) -> Iterator[tuple[KubeStack, Path]]:
    """A kube stack whose API server writes every Workflow request with one of `verbs`
    (DELETEs by default) to the returned log."""
    work_dir.mkdir(parents=True, exist_ok=True)
    policy = work_dir / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY.format(verbs=list(verbs)))
    log = work_dir / "audit.log"
    audit = (
        "--audit-policy-file", str(policy),
        "--audit-log-path", str(log),
        "--audit-log-maxsize", "0",
        # Written before the answer: a DELETE that happened is in the log, however the
        # client fared.
        "--audit-log-mode", "blocking",
    )  # fmt: skip
    with kube_stack(work_dir / "kube", extra_args=(*audit, *extra_args)) as stack:
        yield stack, log


def deletes(audit_log: Path, namespace: str) -> dict[str, list[Request]]:
    """Workflow name -> its DELETE requests in `namespace`, in the order received."""
    return requests(audit_log, namespace, "delete")


def requests(audit_log: Path, namespace: str, *verbs: str) -> dict[str, list[Request]]:
    """Workflow name -> its requests with one of `verbs` in `namespace`, in the order
    received."""
    found: dict[str, list[Request]] = defaultdict(list)
    for line in audit_log.read_text().splitlines():
        request = parse_audit_line(line)
        if (
            request is not None
            and request.namespace == namespace
            and request.name
            and request.verb in verbs
        ):
            found[request.name].append(request)
    for requests in found.values():
        requests.sort(key=lambda r: r.at)
    return dict(found)


def successful(requests: Iterable[Request]) -> list[Request]:
    return [r for r in requests if 200 <= r.code < 300]


def unanswered(requests: Iterable[Request]) -> list[Request]:
    """DELETEs answered 5xx: cut short (the client killed, etcd gone). Such a DELETE may
    have committed all the same: that is what makes a retry find the object gone."""
    return [r for r in requests if r.code >= 500]


def check_one_delete_each(per_object: dict[str, list[Request]], names: Iterable[str]) -> None:
    """Every object in `names` was deleted by exactly one DELETE: one answered 2xx, or, with
    none, one cut short that committed (the caller has checked the object is gone). Never
    two that succeeded."""
    names = list(names)
    lost = sorted(set(names) - set(per_object))
    assert not lost, f"{len(lost)} never DELETEd: {lost[:5]}"
    codes = {n: [r.code for r in per_object[n]] for n in names}
    twice = {n: codes[n] for n in names if len(successful(per_object[n])) > 1}
    assert not twice, f"more than one successful DELETE: {twice}"
    unexplained = {
        n: codes[n]
        for n in names
        if not successful(per_object[n]) and not unanswered(per_object[n])
    }
    assert not unexplained, f"gone without a DELETE that went through: {unexplained}"
