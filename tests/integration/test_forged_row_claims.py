"""Minimised from the forged-input suite (tests/e2e/test_forged_inputs.py): a claim about a
run the API server does not have must not plan anyone's database rows.

The suite found it: a `run.finished` POSTed to `lapse up`'s ingress for a random uid,
naming the KFP run id of rows whose own deadline lapse stored an hour away (and a label a
short database policy matches), had those rows deleted within seconds. The planner timed
the unverifiable claim from now and scheduled its database target under the claimed uid;
"never earlier than a deadline already stored for it" was checked for that uid, while the
rows belong to another run. The row-reaper then proved the deadline from that schedule:
lapse had stored it.

A claim lapse cannot check plans nothing at all, and is recorded as refused; rows are
planned only from a run lapse read itself (the watcher, `lapse reconcile`).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges.kubernetes import KubeObjects
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupFailed, RunFinished
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.functions.policy import Policy
from lapse.functions.trust import Trust
from lapse.functions.ttl_planner import Planner
from tests.conftest import KubeStack
from tests.unit.test_object_reaper_verdict import argo_workflow

STREAMS = Streams()


def short_rows_policy() -> Policy:
    return Policy.model_validate(
        {
            "name": "kfp-runs",
            "match": {"has_labels": [KFP_RUN_ID_LABEL]},
            "kubernetes": {"ttl": "1h"},
            "database": {"ttl": "1s"},
        }
    )


async def test_a_claim_about_a_gone_run_plans_no_rows(
    kube: KubeStack, lapse_streams: JetStreamContext
) -> None:
    ns = kube.namespace("forged-row-claims")
    # The name exists, under another uid (a later run of that name): the claimed run is gone.
    await kube.workflows.create(ns, argo_workflow("reused", namespace=ns))
    victim_rows = str(uuid.uuid4())  # another run's KFP id, its own deadline stored elsewhere
    store = NatsScheduleStore(lapse_streams, STREAMS)
    planner = Planner(
        store,
        NatsEmitter(lapse_streams, STREAMS),
        policies=[short_rows_policy()],
        fetcher=KubeObjects(kube.api_client, kube.executor),
    )
    for name in ("reused", "never-existed"):
        uid = str(uuid.uuid4())
        claim = RunRef(
            engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
            namespace=ns, name=name, uid=uid, phase="Succeeded",
            finished_at=datetime(2000, 1, 1, tzinfo=UTC),
            labels={KFP_RUN_ID_LABEL: victim_rows}, kfp_run_id=victim_rows,
        )  # fmt: skip
        event = build_event(EventType.RUN_FINISHED, source="/forged", data=RunFinished(run=claim))
        [refused] = await planner.handle(event, Trust.CLAIM)

        assert await store.get(Target.DATABASE, uid) is None, f"rows planned on a claim ({name})"
        assert await store.get(Target.KUBERNETES, uid) is None, f"planned on a claim ({name})"
        failed = parse_payload(refused, CleanupFailed)
        assert failed.stage == "planner" and failed.reason.startswith("refused: ")
