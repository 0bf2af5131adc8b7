"""Who may deliver events to a function, and the bridge's proof of who it is.

A Knative Service does not authenticate its callers: any pod that reaches Kourier's gateway
(or the activator) can POST to it. With Knative Eventing's `authentication-oidc` feature on,
a Trigger delivers each event with `Authorization: Bearer <token>`: a ServiceAccount token
of the Trigger's own OIDC identity, for the audience named in the Trigger's
`subscriber.audience` (infra/knative/triggers.yaml). A function checks it here before it
looks at the event:

- no bearer token: 401;
- a token the API server does not accept for this function's audience (a TokenReview with
  `spec.audiences` = [audience]; the API server checks the signature, expiry, audience and
  that the pod or Secret it was bound to still exists): 401;
- a valid token of a subject outside `subjects` (by default: ServiceAccounts of the
  function's own namespace, where Knative makes the Triggers' identities): 403;
- the API server not answering: 503 with Retry-After, so the Broker retries.

A token accepted is remembered until it expires (at most 5 minutes), one refused for a
minute: the Broker reuses its tokens, so a steady stream of events costs one TokenReview
per token, and a flood of forged ones cannot turn into a flood of TokenReviews.

Configured from the environment (infra/knative/functions.yaml sets it per function):
`LAPSE_SENDER_AUDIENCE` (unset: no check, as `lapse serve` on a laptop),
`LAPSE_SENDER_SUBJECTS` (comma-separated shell patterns; default
`system:serviceaccount:<namespace>:*`), `LAPSE_SENDER_REVIEW_TOKEN` (the file holding this
pod's own API token, used for the TokenReview; default the ServiceAccount's).

The other direction: `lapse bridge` POSTs to the Broker, whose ingress verifies the sender
itself (EventPolicy `lapse-broker`). `bearer_header()` reads the token the kubelet projects
into the bridge's pod for the Broker's audience (`LAPSE_SINK_TOKEN_FILE`), afresh each
time (the kubelet rotates it).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import logging
import os
import ssl
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

from lapse.runtime.asgi import Send, respond

log = logging.getLogger(__name__)

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ACCEPTED_FOR: Final = 300.0
REFUSED_FOR: Final = 60.0
CACHE_SIZE: Final = 1024
REVIEW_TIMEOUT: Final = 10.0


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted, as the HTTP answer to give."""

    status: int
    reason: str
    retry_after: float | None = None


class SenderCheck:
    """Admits a request only with a bearer token for `audience` from one of `subjects`."""

    def __init__(
        self,
        audience: str,
        subjects: Iterable[str],
        *,
        api_server: str,
        review_token: Path,
        ca_file: Path,
    ) -> None:
        self.audience = audience
        self.subjects = tuple(subjects)
        self._url = f"{api_server}/apis/authentication.k8s.io/v1/tokenreviews"
        self._review_token = review_token
        self._ca_file = ca_file
        self._client: httpx.AsyncClient | None = None
        # sha256 of a token -> (until when, subject or "" when refused, why refused)
        self._seen: dict[str, tuple[float, str, str]] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SenderCheck | None:
        audience = env.get("LAPSE_SENDER_AUDIENCE", "").strip()
        if not audience:
            return None
        namespace_file = SERVICE_ACCOUNT / "namespace"
        namespace = env.get("POD_NAMESPACE") or (
            namespace_file.read_text().strip() if namespace_file.exists() else "lapse-system"
        )
        subjects = [
            s.strip()
            for s in env.get("LAPSE_SENDER_SUBJECTS", f"system:serviceaccount:{namespace}:*").split(
                ","
            )
            if s.strip()
        ]
        host = env.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        return cls(
            audience,
            subjects,
            api_server=f"https://{host}:{port}",
            review_token=Path(env.get("LAPSE_SENDER_REVIEW_TOKEN", str(SERVICE_ACCOUNT / "token"))),
            ca_file=Path(env.get("LAPSE_SENDER_REVIEW_CA", str(SERVICE_ACCOUNT / "ca.crt"))),
        )

    async def admit(self, headers: Iterable[tuple[bytes, bytes]]) -> Refusal | None:
        """None when the request may be handled, else the answer to give."""
        token = _bearer(headers)
        if not token:
            return Refusal(401, "no bearer token: only the Broker's Triggers may deliver here")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is None or seen[0] < now:
            try:
                subject, why = await self._review(token)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.warning("sender check: TokenReview failed: %s: %s", type(exc).__name__, exc)
                return Refusal(503, f"cannot check the sender now: {type(exc).__name__}", 5.0)
            if len(self._seen) >= CACHE_SIZE:
                self._seen.clear()
            keep = min(ACCEPTED_FOR, _seconds_left(token)) if subject else REFUSED_FOR
            until = now + keep
            seen = self._seen[key] = (until, subject, why)
        _, subject, why = seen
        if not subject:
            return Refusal(401, f"token refused: {why}")
        if not any(fnmatch.fnmatchcase(subject, pattern) for pattern in self.subjects):
            return Refusal(403, f"{subject} may not deliver events here")
        return None

    async def _review(self, token: str) -> tuple[str, str]:
        """(subject, "") when the API server accepts the token for our audience, else
        ("", why)."""
        if self._client is None:
            trusted = ssl.create_default_context(cafile=str(self._ca_file))
            self._client = httpx.AsyncClient(verify=trusted, timeout=REVIEW_TIMEOUT)
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        own = self._review_token.read_text().strip()
        response = await self._client.post(
            self._url, json=review, headers={"Authorization": f"Bearer {own}"}
        )
        if response.status_code != 201 and response.status_code != 200:
            raise ValueError(f"TokenReview answered {response.status_code}: {response.text[:200]}")
        status = response.json().get("status", {})
        if not status.get("authenticated"):
            return "", status.get("error") or "not authenticated"
        if self.audience not in status.get("audiences", []):
            return "", f"not for audience {self.audience}"
        return str(status.get("user", {}).get("username", "")), ""

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def refused(check: SenderCheck | None, scope: Mapping[str, Any], send: Send) -> bool:
    """The hook in the function shell (lapse/runtime/knative.py): True when the request was
    answered with a refusal and must not be handled; always False without a check."""
    if check is None:
        return False
    refusal = await check.admit(scope.get("headers", []))
    if refusal is None:
        return False
    log.warning("refused a request: %s %s", refusal.status, refusal.reason)
    await respond(send, refusal.status, refusal.reason, retry_after=refusal.retry_after)
    return True


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def _seconds_left(token: str) -> float:
    """Until the token's `exp` (read only after the API server accepted the token)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return max(float(claims["exp"]) - time.time(), 0.0)
    except (IndexError, KeyError, TypeError, ValueError):
        return 0.0


def bearer_header(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`Authorization` for the bridge's POST to the Broker, from the projected token file
    (`LAPSE_SINK_TOKEN_FILE`); no header when that is not set."""
    path = env.get("LAPSE_SINK_TOKEN_FILE", "")
    if not path:
        return {}
    token = Path(path).read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}
