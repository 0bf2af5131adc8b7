"""Every span attribute and metric lapse emits, named in one place.

Span names
  send <subject>             PRODUCER  a NATS publish (schedule, audit, dead letter, ingress)
  process <subject>          CONSUMER  a NATS delivery handled by the dispatcher
  POST /                     SERVER    an HTTP delivery (Knative Broker -> func-python shell)
  <function>                 INTERNAL  one handler call: ttl-planner, object-reaper, row-reaper
  schedule|cancel <target>   INTERNAL  one planner decision; the due event's own traceparent
  <METHOD> <url template>    CLIENT    a Kubernetes API request
  <OPERATION> <table>        CLIENT    a database statement
Subjects that carry a run uid appear as a template (`lapse.due.kubernetes.*`), so span
names stay few. A due event is processed in a new trace that LINKS to where it was
scheduled; `lapse.link` on the link says which context it is: `creation` (the CloudEvent's
traceparent extension) or `hop` (the span that published the message).

Metric names map to Prometheus names the usual way: dots become underscores, the unit is
appended (`s` -> `_seconds`; `{...}` annotations are dropped), counters end in `_total`,
histograms expand to `_bucket`/`_sum`/`_count`; attribute dots become underscores too
(`lapse.target` -> `lapse_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from lapse.functions import tracing as handler_names

SCOPE: Final = "lapse"

# OpenTelemetry semantic conventions (CloudEvents, messaging, HTTP, database).
CE_ID: Final = "cloudevents.event_id"
CE_SOURCE: Final = "cloudevents.event_source"
CE_TYPE: Final = "cloudevents.event_type"
CE_SUBJECT: Final = "cloudevents.event_subject"
CE_SPEC_VERSION: Final = "cloudevents.event_spec_version"
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_DESTINATION: Final = "messaging.destination.name"
MESSAGING_TEMPLATE: Final = "messaging.destination.template"
MESSAGING_SUBSCRIPTION: Final = "messaging.destination.subscription.name"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
MESSAGING_BODY_SIZE: Final = "messaging.message.body.size"
HTTP_METHOD: Final = "http.request.method"
HTTP_STATUS: Final = "http.response.status_code"
HTTP_ROUTE: Final = "http.route"
URL_TEMPLATE: Final = "url.template"
URL_PATH: Final = "url.path"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
DB_SYSTEM: Final = "db.system.name"
DB_NAMESPACE: Final = "db.namespace"
DB_OPERATION: Final = "db.operation.name"
DB_COLLECTION: Final = "db.collection.name"
DB_QUERY: Final = "db.query.text"
ERROR_TYPE: Final = "error.type"
# `messaging.system` has no registered value for NATS yet.
NATS: Final = "nats"

# lapse's own. The run, target and schedule names are set by the handlers themselves and
# defined beside them (lapse.functions.tracing); listed here with the rest.
RUN_NAMESPACE: Final = handler_names.RUN_NAMESPACE
RUN_NAME: Final = handler_names.RUN_NAME
RUN_UID: Final = handler_names.RUN_UID
RUN_ENGINE: Final = handler_names.RUN_ENGINE
TARGET: Final = handler_names.TARGET
DEADLINE: Final = handler_names.DEADLINE
POLICY: Final = handler_names.POLICY
SCHEDULE_ACTION: Final = handler_names.SCHEDULE_ACTION
ARTIFACT_STORE: Final = "lapse.artifact.store"
FUNCTION: Final = "lapse.function"
OUTCOME: Final = "lapse.outcome"  # a cleanup.completed outcome, or "failed"
LATENESS: Final = "lapse.lateness_seconds"  # completed - deadline
DELIVERY_ATTEMPT: Final = "lapse.delivery.attempt"
RETRY_REASON: Final = "lapse.retry.reason"
RETRY_DELAY: Final = "lapse.retry.delay_seconds"
LINK_KIND: Final = "lapse.link"  # on links: creation | hop
API: Final = "lapse.api"  # kubernetes | database
HANDLER_RESULT: Final = "lapse.handler.result"  # ok | retry | error
WATCHED_KIND: Final = "lapse.kind"  # a configured kind's name (`kinds:`)
# too_large | not_cloudevent | invalid | unrouted | unauthorized
INGRESS_REJECTION: Final = "lapse.ingress.rejection"
INGRESS_RECORDED: Final = "lapse.ingress.recorded"  # false: beyond max_records_per_minute
# listed | planned | repaired | failed | error (the safety net's runs, per pass)
RECONCILE_OUTCOME: Final = "lapse.reconcile.outcome"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["counter", "histogram", "gauge"]
    unit: str
    description: str
    attributes: tuple[str, ...]
    buckets: tuple[float, ...] | None = None


DELETIONS: Final = MetricSpec(
    "lapse.deletions", "counter", "{deletion}",
    "Due deadlines handled, by target and outcome (deleted counts what was really deleted; "
    "failed counts cleanup.failed, including dead letters after the last try)",
    (TARGET, OUTCOME),
)  # fmt: skip
LATENESS_SECONDS: Final = MetricSpec(
    "lapse.deletion.lateness", "histogram", "s",
    "Seconds from the deadline to the deletion, for outcome=deleted",
    (TARGET,),
    (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 86400.0),
)  # fmt: skip
SCHEDULE_CHANGES: Final = MetricSpec(
    "lapse.schedule.changes", "counter", "{schedule}",
    "Schedules the planner created, replaced (deadline moved) or cancelled",
    (TARGET, SCHEDULE_ACTION),
)  # fmt: skip
PENDING: Final = MetricSpec(
    "lapse.schedule.pending", "gauge", "{schedule}",
    "Schedules pending in the stream, per target (polled by the lapse up runtime)",
    (TARGET,),
)  # fmt: skip
DLQ_DEPTH: Final = MetricSpec(
    "lapse.dlq.depth", "gauge", "{message}",
    "Messages in the dead-letter stream (polled by the lapse up runtime)",
    (),
)  # fmt: skip
RETRIES: Final = MetricSpec(
    "lapse.retries", "counter", "{retry}",
    "Deliveries handed back for another try (NAK with delay, or HTTP 503/500 to the Broker)",
    (FUNCTION, ERROR_TYPE),
)  # fmt: skip
DELETION_CALLS: Final = MetricSpec(
    "lapse.deletion.calls", "histogram", "{call}",
    "Kubernetes API requests or database statements made to handle one due deadline",
    (TARGET, OUTCOME, API),
    (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 13.0, 21.0, 34.0),
)  # fmt: skip
KUBERNETES_REQUESTS: Final = MetricSpec(
    "lapse.kubernetes.requests", "counter", "{request}",
    "Kubernetes API requests, by method and status (the watcher's included)",
    (HTTP_METHOD, HTTP_STATUS),
)  # fmt: skip
DATABASE_STATEMENTS: Final = MetricSpec(
    "lapse.database.statements", "counter", "{statement}",
    "Database statements executed, by operation",
    (DB_OPERATION,),
)  # fmt: skip
ARTIFACTS_DELETED: Final = MetricSpec(
    "lapse.artifacts.deleted", "counter", "{object}",
    "Objects the artifact reaper deleted in object storage, by store",
    (ARTIFACT_STORE,),
)  # fmt: skip
ARTIFACTS_FREED: Final = MetricSpec(
    "lapse.artifacts.freed", "counter", "By",
    "Bytes the artifact reaper freed in object storage (the deleted objects' sizes), by store",
    (ARTIFACT_STORE,),
)  # fmt: skip
HANDLER_DURATION: Final = MetricSpec(
    "lapse.handler.duration", "histogram", "s",
    "Time one handler call took, by function, event type and result (ok, retry, error)",
    (FUNCTION, CE_TYPE, HANDLER_RESULT),
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)  # fmt: skip
INGRESS_REJECTIONS: Final = MetricSpec(
    "lapse.ingress.rejections", "counter", "{request}",
    "Pushed CloudEvents the ingress refused (4xx), by status and why; recorded=false when "
    "the cleanup.failed record was skipped by ingress.max_records_per_minute",
    (HTTP_STATUS, INGRESS_REJECTION, INGRESS_RECORDED),
)  # fmt: skip

WAITING: Final = MetricSpec(
    "lapse.waiting", "gauge", "{event}",
    "Events a function is waiting to handle again after a transient failure (an unreachable "
    "API server or database, 429, 5xx); they are never dead-lettered for it",
    (FUNCTION,),
)  # fmt: skip
OUTAGE_SECONDS: Final = MetricSpec(
    "lapse.outage.duration", "gauge", "s",
    "How long a function, or a background task of lapse up (a watcher, the policy "
    "watcher), has been waiting out a transient failure (0 when it is not)",
    (FUNCTION,),
)  # fmt: skip
WATCH_LEASES: Final = MetricSpec(
    "lapse.watch.leases", "gauge", "{kind}",
    "The kinds whose watch this process runs, 1 each: with kubernetes.watch_lease on, one "
    "process per kind among those sharing the NATS (their sum per kind is 1 when healthy)",
    (WATCHED_KIND,),
)  # fmt: skip
RECONCILE_RUNS: Final = MetricSpec(
    "lapse.reconcile.runs", "counter", "{run}",
    "The safety net's finished runs (the Knative shape's periodic reconcile): listed, planned "
    "(they had no schedule: an event was lost), repaired (a stale deadline moved or "
    "withdrawn), failed (the planner refused) and error (could not be planned)",
    (RECONCILE_OUTCOME,),
)  # fmt: skip
RECONCILE_DURATION: Final = MetricSpec(
    "lapse.reconcile.duration", "histogram", "s",
    "Time one safety-net pass took, by result (ok, error)",
    (HANDLER_RESULT,),
    (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)  # fmt: skip
RECONCILE_LAST_SUCCESS: Final = MetricSpec(
    "lapse.reconcile.last_success", "gauge", "s",
    "When the last safety-net pass without an error ended (Unix time)",
    (),
)  # fmt: skip

METRICS: Final[tuple[MetricSpec, ...]] = (
    DELETIONS,
    LATENESS_SECONDS,
    SCHEDULE_CHANGES,
    PENDING,
    DLQ_DEPTH,
    RETRIES,
    DELETION_CALLS,
    KUBERNETES_REQUESTS,
    DATABASE_STATEMENTS,
    ARTIFACTS_DELETED,
    ARTIFACTS_FREED,
    HANDLER_DURATION,
    WAITING,
    OUTAGE_SECONDS,
    WATCH_LEASES,
    INGRESS_REJECTIONS,
    RECONCILE_RUNS,
    RECONCILE_DURATION,
    RECONCILE_LAST_SUCCESS,
)
