"""The tenant boundary of the row-reaper (issues 36 and 37), on real PostgreSQL and MariaDB
and through `lapse up`.

Found against `lapse up`: a Workflow of one namespace labelled `pipeline/runid: <a KFP run of
another namespace>` had that run's rows deleted at its own deadline, although KFP's
`run_details.Namespace` names the other namespace; and a run outside `safety.namespaces`
kept its object but lost its rows. The key a label gives is a tenant's word: a run's rows
are deleted only where the database's own record (KFP's run_details, Argo's archive, a
declared `namespace_column`) names the namespace lapse stored with the run, held in the
locked transaction; ML Metadata only for a run id KFP's record vouched for; and a run
outside `safety.namespaces` is `skipped` (docs/security.md, "Tenants and databases").
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from sqlalchemy import (
    Column,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config import DatabaseTargets
from lapse.edges.database import create_engine
from lapse.edges.rows import SchemaMismatch, open_row_store
from lapse.embedded.nats import EmbeddedNats
from lapse.events.models import CleanupCompleted
from lapse.events.types import Outcome
from lapse.functions.row_reaper import TargetSpec, targets_for
from lapse.functions.row_reaper.targets import argo_archive_target, kfp_target, mlmd_target
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Trust
from tests import argo_archive_schema as argo
from tests import kfp_schema as kfp
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_forged_inputs import generate
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.integration.test_ml_metadata import Mlmd, mlmd_python, runs  # noqa: F401 (a fixture)
from tests.integration.test_row_reaper import Backed, ListEmitter, completed, due
from tests.stack import Database, scratch_database, wait_for

pytestmark = pytest.mark.db

A, B, C = "tenant-a", "tenant-b", "tenant-c"

TENANT_TABLES = MetaData()
tenant_runs = Table(
    "tenant_runs",
    TENANT_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_key", String(64), nullable=False, index=True),
    Column("owner_ns", String(63), nullable=False),
)
tenant_files = Table(
    "tenant_run_files",
    TENANT_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_key", String(64), nullable=False, index=True),
)
tenant_tags = Table(
    "tenant_run_tags",
    TENANT_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("tenant_runs.id"), nullable=False),
)
RUN_LABEL = "example.com/run"


def declared(namespace_column: str | None = "owner_ns") -> list[TargetSpec]:
    table: dict[str, Any] = {
        "name": "tenant-runs",
        "table": "tenant_runs",
        "key_column": "run_key",
        "key_from": f"label:{RUN_LABEL}",
        "children": [
            {"table": "tenant_run_files", "foreign_key_column": "run_key"},
            {"table": "tenant_run_tags", "foreign_key_column": "run_id"},
        ],
    }
    if namespace_column is not None:
        table["namespace_column"] = namespace_column
    return targets_for(DatabaseTargets.model_validate({"tables": [table]}))


@pytest.fixture
async def engine(database: Database) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database.url)
    await kfp.create_kfp_tables(engine)
    await argo.create_argo_tables(engine)
    async with engine.begin() as conn:
        await conn.run_sync(TENANT_TABLES.create_all)
    yield engine
    async with engine.begin() as conn:
        await conn.run_sync(TENANT_TABLES.drop_all)
    await kfp.drop_kfp_tables(engine)
    await argo.drop_argo_tables(engine)
    await engine.dispose()


async def reaper(
    engine: AsyncEngine, targets: list[TargetSpec], **safety: Any
) -> tuple[Backed, ListEmitter]:
    emitter = ListEmitter()
    store = await open_row_store(engine, targets)
    return Backed(store, emitter, safety=SafetyConfig.model_validate(safety)), emitter


async def batch(handler: Backed, events: list[Any]) -> list[CleanupCompleted]:
    """The events delivered as one fetch (one transaction for the runs that reach it)."""
    answers = await handler.inner.handle_batch(
        [(handler.stored.fired(event), Trust.CLAIM) for event in events]
    )
    results = []
    for answer in answers:
        assert not isinstance(answer, Exception), answer
        [outcome] = answer
        results.append(completed(outcome))
    return results


async def kfp_rows_of(engine: AsyncEngine, run_id: str) -> dict[str, int]:
    async with engine.connect() as conn:
        return await kfp.kfp_counts(conn, run_id)


async def insert_kfp(engine: AsyncEngine, namespace: str, *run_ids: str) -> None:
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, run_ids, namespace=namespace)


FULL_KFP = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
NONE_KFP = dict.fromkeys(kfp.KFP_TABLES, 0)


# --- KFP: the run id a label names, against run_details.Namespace ---------------------------


async def test_a_label_naming_another_namespaces_kfp_run_is_refused_and_its_rows_stay(
    engine: AsyncEngine,
) -> None:
    theirs, ours = str(uuid.uuid4()), str(uuid.uuid4())
    await insert_kfp(engine, B, theirs)
    await insert_kfp(engine, A, ours)
    handler, _ = await reaper(engine, [kfp_target(), argo_archive_target("default")])

    # One fetch, one transaction: A's Workflow labelled with B's run, and A's own run.
    thief, own = await batch(
        handler,
        [
            due(kfp_run_id=theirs, name="thief", namespace=A),
            due(kfp_run_id=ours, name="own", namespace=A),
        ],
    )

    assert thief.outcome is Outcome.REFUSED, thief
    assert f"namespace {B!r}, not {A!r}" in (thief.detail or ""), thief.detail
    assert "nothing was deleted" in (thief.detail or "")
    assert await kfp_rows_of(engine, theirs) == FULL_KFP
    assert own.outcome is Outcome.DELETED, own
    assert await kfp_rows_of(engine, ours) == NONE_KFP

    # B's own Workflow, at its own deadline, has them deleted.
    [mine] = await batch(handler, [due(kfp_run_id=theirs, name="mine", namespace=B)])
    assert mine.outcome is Outcome.DELETED, mine
    assert await kfp_rows_of(engine, theirs) == NONE_KFP


async def test_single_user_kfp_runs_are_the_kfp_namespaces_alone(engine: AsyncEngine) -> None:
    """KFP in single-user mode records no namespace (run_details.Namespace empty): its runs
    are those of the namespace KFP is installed in (single_user_namespace, kubeflow)."""
    run = str(uuid.uuid4())
    await insert_kfp(engine, "", run)
    handler, _ = await reaper(engine, [kfp_target()])

    [thief] = await batch(handler, [due(kfp_run_id=run, name="thief", namespace=A)])
    assert thief.outcome is Outcome.REFUSED, thief
    assert await kfp_rows_of(engine, run) == FULL_KFP

    [own] = await batch(handler, [due(kfp_run_id=run, name="own", namespace="kubeflow")])
    assert own.outcome is Outcome.DELETED, own
    assert await kfp_rows_of(engine, run) == NONE_KFP


def tenant_batches(pool: dict[str, list[str]]) -> st.SearchStrategy[list[tuple[str, str]]]:
    """Due runs as (namespace, the KFP run id its label names): any pool run, or none KFP has."""
    ids = [run for runs in pool.values() for run in runs] + ["not-a-kfp-run"]
    return st.lists(st.tuples(st.sampled_from([A, B, C]), st.sampled_from(ids)), max_size=6)


async def test_random_labels_and_namespaces_never_touch_another_namespaces_rows(
    engine: AsyncEngine,
) -> None:
    """Whatever namespaces due runs are of and whichever runs their labels name, delivered
    in one fetch: a row set goes only when a run of its own namespace named it."""
    # Drawn from placeholders, then each example gets fresh run ids (the tables persist).
    placeholders = {ns: [f"{ns}-0", f"{ns}-1"] for ns in (A, B, C)}
    examples = generate(tenant_batches(placeholders), 25)
    handler, _ = await reaper(engine, [kfp_target()])
    outcomes: Counter[str] = Counter()
    for example in examples:
        fresh = {p: str(uuid.uuid4()) for ps in placeholders.values() for p in ps}
        for ns, ps in placeholders.items():
            await insert_kfp(engine, ns, *(fresh[p] for p in ps))
        dues = [(ns, fresh.get(named, named)) for ns, named in example]
        results = await batch(
            handler, [due(kfp_run_id=run, namespace=ns, name=f"w{i}") for i, (ns, run) in
                      enumerate(dues)],
        )  # fmt: skip
        for ns, placeholder_runs in placeholders.items():
            for p in placeholder_runs:
                claimed_by_owner = (ns, fresh[p]) in dues
                rows = NONE_KFP if claimed_by_owner else FULL_KFP
                assert await kfp_rows_of(engine, fresh[p]) == rows, (example, p)
        for i, ((ns, run), result) in enumerate(zip(dues, results, strict=True)):
            owner = next((o for o, ps in placeholders.items() if run in map(fresh.get, ps)), None)
            if owner is not None and owner != ns:
                # Refused, unless its owner's run had them deleted in an earlier round.
                gone_before = (owner, run) in dues[:i]
                ends = Outcome.ALREADY_GONE if gone_before else Outcome.REFUSED
                assert result.outcome is ends, (example, result)
            else:
                assert result.outcome in (Outcome.DELETED, Outcome.ALREADY_GONE), result
            outcomes[result.outcome] += 1
    assert outcomes[Outcome.REFUSED] > 0 and outcomes[Outcome.DELETED] > 0, outcomes


# --- the Argo archive: its namespace column --------------------------------------------------


async def test_archive_rows_of_another_namespace_are_refused_and_stay(
    engine: AsyncEngine,
) -> None:
    uid = str(uuid.uuid4())
    async with engine.begin() as conn:
        await argo.insert_archived(conn, uid, namespace=B, label_count=2, node_versions=2)
    handler, _ = await reaper(engine, [argo_archive_target("default")])

    [result] = await batch(handler, [due(uid=uid, namespace=A)])

    assert result.outcome is Outcome.REFUSED, result
    assert f"namespace {B!r}" in (result.detail or "")
    async with engine.connect() as conn:
        assert await argo.argo_counts(conn, uid) == {
            "argo_archived_workflows": 1,
            "argo_archived_workflows_labels": 2,
            "argo_workflows": 2,
        }


# --- a declared table with a namespace column ------------------------------------------------


async def seed_tenant_rows(engine: AsyncEngine, key: str, namespace: str) -> None:
    async with engine.begin() as conn:
        result = await conn.execute(insert(tenant_runs).values(run_key=key, owner_ns=namespace))
        assert result.inserted_primary_key is not None
        parent = result.inserted_primary_key[0]
        await conn.execute(insert(tenant_files), [{"run_key": key}] * 3)
        await conn.execute(insert(tenant_tags), [{"run_id": parent}] * 2)


async def tenant_counts(engine: AsyncEngine, key: str) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        parents = await conn.execute(
            select(func.count()).select_from(tenant_runs).where(tenant_runs.c.run_key == key)
        )
        files = await conn.execute(
            select(func.count()).select_from(tenant_files).where(tenant_files.c.run_key == key)
        )
        tags = await conn.execute(
            select(func.count())
            .select_from(tenant_tags.join(tenant_runs))
            .where(tenant_runs.c.run_key == key)
        )
        return parents.scalar_one(), files.scalar_one(), tags.scalar_one()


async def test_a_declared_namespace_column_holds_the_label_key_to_its_namespace(
    engine: AsyncEngine,
) -> None:
    theirs, ours = f"run-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    await seed_tenant_rows(engine, theirs, B)
    await seed_tenant_rows(engine, ours, A)
    handler, _ = await reaper(engine, declared())

    thief, own = await batch(
        handler,
        [
            due(labels={RUN_LABEL: theirs}, name="thief", namespace=A),
            due(labels={RUN_LABEL: ours}, name="own", namespace=A),
        ],
    )

    assert thief.outcome is Outcome.REFUSED, thief
    assert f"namespace {B!r}, not {A!r}" in (thief.detail or "")
    assert await tenant_counts(engine, theirs) == (1, 3, 2)
    assert own.outcome is Outcome.DELETED, own
    assert own.detail == "tenant-runs: tenant_run_files=3, tenant_run_tags=2, tenant_runs=1"
    assert await tenant_counts(engine, ours) == (0, 0, 0)


async def test_a_declared_namespace_column_is_checked_at_start(engine: AsyncEngine) -> None:
    with pytest.raises(SchemaMismatch) as refused:
        await open_row_store(engine, declared("no_such_column"))
    assert "database.targets.tables[0].namespace_column" in str(refused.value)
    assert "no column 'no_such_column'" in str(refused.value)


# --- scope: safety.namespaces bounds the rows too ------------------------------------------


async def test_a_run_outside_safety_namespaces_keeps_its_rows(engine: AsyncEngine) -> None:
    run, key = str(uuid.uuid4()), f"run-{uuid.uuid4().hex[:8]}"
    await insert_kfp(engine, B, run)
    await seed_tenant_rows(engine, key, B)
    # The declared table has no namespace column: scope alone keeps its rows.
    targets = [kfp_target(), *declared(namespace_column=None)]
    included, _ = await reaper(engine, targets, namespaces={"include": [A]})
    excluded, _ = await reaper(engine, targets, namespaces={"exclude": ["tenant-b*"]})

    [outside] = await batch(included, [due(kfp_run_id=run, labels={RUN_LABEL: key}, namespace=B)])
    [out] = await batch(excluded, [due(kfp_run_id=run, labels={RUN_LABEL: key}, namespace=B)])

    assert outside.outcome is Outcome.SKIPPED, outside
    assert "matches no safety.namespaces.include pattern" in (outside.detail or "")
    assert out.outcome is Outcome.SKIPPED, out
    assert "excluded by safety.namespaces.exclude 'tenant-b*'" in (out.detail or "")
    assert await kfp_rows_of(engine, run) == FULL_KFP
    assert await tenant_counts(engine, key) == (1, 3, 2)


# --- ML Metadata: only for a run id KFP's record vouched for --------------------------------


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
async def test_ml_metadata_goes_only_with_a_run_kfp_names_the_runs(
    engine: AsyncEngine,
    mlmd: Mlmd,
) -> None:
    theirs, unknown, b2 = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    await mlmd.write(*runs(theirs, b2))
    await mlmd.write(runs(unknown, str(uuid.uuid4()))[0])
    await insert_kfp(engine, B, theirs)
    handler, _ = await reaper(engine, [kfp_target(), mlmd_target(mlmd.database)])

    thief, orphan = await batch(
        handler,
        [
            due(kfp_run_id=theirs, name="thief", namespace=A),
            # MLMD has this run, KFP has not: nothing the tenant cannot write says whose.
            due(kfp_run_id=unknown, name="orphan", namespace=A),
        ],
    )

    assert thief.outcome is Outcome.REFUSED, thief
    assert orphan.outcome is Outcome.ALREADY_GONE, orphan
    assert "ml_metadata: skipped (not deleted: KFP's database has no run" in (orphan.detail or "")
    read = await mlmd.read(theirs, unknown)
    assert read["runs"][theirs] is not None and read["runs"][unknown] is not None
    assert await kfp_rows_of(engine, theirs) == FULL_KFP

    [mine] = await batch(handler, [due(kfp_run_id=theirs, name="mine", namespace=B)])
    assert mine.outcome is Outcome.DELETED, mine
    assert (await mlmd.read(theirs))["runs"][theirs] is None


@pytest.fixture
async def mlmd(
    engine: AsyncEngine,
    database: Database,
    mlmd_python: str,  # noqa: F811
) -> AsyncIterator[Mlmd]:
    name = f"metadb_{uuid.uuid4().hex[:8]}"
    async with engine.connect() as conn:
        await conn.execute(text(f"CREATE DATABASE {name}"))
    yield Mlmd(mlmd_python, database.url, name)
    async with engine.connect() as conn:
        await conn.execute(text(f"DROP DATABASE {name}"))


# --- through `lapse up` --------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: `lapse up` watches every namespace (the run outside scope too).
    with kube_stack(tmp_path_factory.mktemp("kube-tenant-rows")) as stack:
        yield stack


@pytest.mark.kube
@pytest.mark.nats
async def test_up_deletes_no_rows_of_another_namespace_or_outside_scope(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    suffix = uuid.uuid4().hex[:6]
    ns_a = kube.namespace(f"tenant-a-{suffix}")
    ns_b = kube.namespace(f"tenant-b-{suffix}")
    outside = kube.namespace(f"outside-{suffix}")
    own, theirs, far = (str(uuid.uuid4()) for _ in range(3))
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        try:
            await kfp.create_kfp_tables(engine)
            await insert_kfp(engine, ns_a, own)
            await insert_kfp(engine, ns_b, theirs)
            await insert_kfp(engine, outside, far)
            config = tmp_path / "lapse.yaml"
            config.write_text(
                f"nats: {{url: '{own_nats.url}'}}\n"
                f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
                f"database: {{url: '{db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
                "policies:\n"
                "  - name: kfp-runs\n"
                "    match: {has_labels: [pipeline/runid]}\n"
                "    kubernetes: {ttl: 1h}\n"
                "    database: {ttl: 2s}\n"
                f"safety: {{namespaces: {{include: ['{ns_a}', '{ns_b}']}}}}\n"
            )
            up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
            await up.start()
            try:
                for ns, name, run in (
                    (ns_a, "own", own),
                    (ns_a, "thief", theirs),  # A's Workflow, B's run id
                    (outside, "far", far),  # a run of a namespace lapse must not touch
                ):
                    labels = {"pipeline/runid": run, "pipeline/persistedFinalState": "true"}
                    await kube.workflows.create(ns, finished_workflow(name, labels=labels))

                def database_outcomes(ns: str) -> dict[str, dict[str, Any]]:
                    rows = lapse_json("history", "-n", ns, "--target", "database", config=config)
                    return {row["name"]: row for row in rows}

                async def all_ended() -> bool:
                    return set(database_outcomes(ns_a)) == {"own", "thief"} and set(
                        database_outcomes(outside)
                    ) == {"far"}

                await wait_for(all_ended, timeout=45, interval=1)
                ended = database_outcomes(ns_a) | database_outcomes(outside)
                assert ended["own"]["outcome"] == "deleted", ended["own"]
                assert ended["thief"]["outcome"] == "refused", ended["thief"]
                assert f"namespace {ns_b!r}, not {ns_a!r}" in ended["thief"]["detail"]
                assert ended["far"]["outcome"] == "skipped", ended["far"]
                assert "safety.namespaces" in ended["far"]["detail"]
                assert await kfp_rows_of(engine, own) == NONE_KFP
                assert await kfp_rows_of(engine, theirs) == FULL_KFP
                assert await kfp_rows_of(engine, far) == FULL_KFP
            finally:
                assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
        finally:
            await engine.dispose()
