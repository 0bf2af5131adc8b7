"""What ends a try of a background task means: waited out, or fatal (`fault_of`).

The one classification of `lapse up`'s supervised tasks' failures (lapse/runtime/supervisor.py).
Apart from lapse/runtime/outages.py, which the functions use: this one knows the Kubernetes
client's exceptions, and the row-reaper's image carries no Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from nats.js import errors as js_errors

from lapse.config import ConfigError
from lapse.edges.kubernetes.client import api_failure
from lapse.functions.ports import RetryLater
from lapse.functions.reaping.failures import transient
from lapse.runtime.outages import STREAM_NOT_FOUND, nats_unavailable

# The answers that retrying cannot change: the credentials or the RBAC are wrong until an
# operator fixes them (and a restart then picks up the fix).
# 401: lapse's own credentials are rejected, which only a new configuration changes. A 403 is
# the cluster's RBAC, which an administrator grants while lapse runs (as client-go's
# reflectors do, it is waited out and shown, not a CrashLoopBackOff).
FATAL_STATUSES = frozenset({401})
FORBIDDEN = 403


@dataclass(frozen=True)
class Fault:
    """What a background task's failure means: `fatal` (the process ends: a configuration
    error), else waited out; `unexpected` when it is neither an outage nor configuration
    (a bug, waited out too, but logged with its traceback)."""

    reason: str
    fatal: bool = False
    unexpected: bool = False
    retry_after: float | None = None


def fault_of(exc: BaseException) -> Fault:
    """The one classification of what ends a try of a background task (docs/architecture.md,
    "Transient is not failed"): the API server or NATS unreachable, timeouts, 408, 429 and
    5xx are transient, and so are 403 (RBAC granted later) and a NATS stream not found
    (created later); 401 and a configuration error are fatal; anything else is
    unexpected, and waited out like a transient fault."""
    if (reason := nats_unavailable(exc)) is not None:
        return Fault(reason)
    if isinstance(exc, RetryLater):
        return Fault(exc.reason, retry_after=exc.delay)
    if isinstance(exc, js_errors.NotFoundError) and exc.err_code == STREAM_NOT_FOUND:
        # Not there yet (the bridge started before lapse up or the install made the
        # streams) or re-created by an operator: waited for, as a CRD not installed is.
        return Fault(f"NATS stream not found, waiting for it ({exc.description})")
    if isinstance(exc, ConfigError | ConfigException):
        return Fault(f"configuration error: {exc}", fatal=True)
    if isinstance(exc, ApiException | urllib3.exceptions.HTTPError):
        # Only the Kubernetes client speaks urllib3 in lapse: its failures are the API
        # server's.
        failure = api_failure(exc)
        assert failure is not None
        status = failure.status
        if status is None:
            return Fault(f"API server unreachable ({failure.message})")
        answered = f"answered {status}: {failure.message}"
        if status in FATAL_STATUSES:
            return Fault(f"API server refused lapse ({answered})", fatal=True)
        if status == FORBIDDEN:
            return Fault(f"API server forbids it, waiting for RBAC ({answered})")
        if transient(status):
            return Fault(f"API server unavailable ({answered})", retry_after=failure.retry_after)
        return Fault(f"API server {answered}", unexpected=True)
    if isinstance(exc, TimeoutError):
        return Fault(f"timed out ({exc or type(exc).__name__})")
    if isinstance(exc, ConnectionError):
        return Fault(f"connection failed ({type(exc).__name__}: {exc})")
    return Fault(f"{type(exc).__name__}: {exc}", unexpected=True)
