"""KFP's run_details rows: finished runs read page by page, as run references."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy import Row, column, func, select, table
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.events.adapters import argo
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef
from lapse.functions.row_reaper.targets import KFP_SINGLE_USER_NAMESPACE
from lapse.operations.reconcile.counts import one_line

# KFP in single-user mode leaves run_details.Namespace empty; its runs live in the
# namespace KFP is installed in, by default this one (the row-reaper's default too).
KFP_DEFAULT_NAMESPACE: Final = KFP_SINGLE_USER_NAMESPACE

# KFP v2 run states (and v1 `Conditions`) as the Argo phase words the audit trail uses.
_KFP_PHASES: Final = {
    "SUCCEEDED": "Succeeded",
    "SKIPPED": "Succeeded",
    "FAILED": "Failed",
    "CANCELED": "Failed",
    "Succeeded": "Succeeded",
    "Skipped": "Succeeded",
    "Failed": "Failed",
    "Error": "Error",
    "Terminated": "Failed",
}

_RUN_DETAILS = table(
    "run_details",
    column("UUID"),
    column("Namespace"),
    column("Name"),
    column("FinishedAtInSec"),
    column("State"),
    column("Conditions"),
)


def kfp_run(row: Row[Any]) -> RunRef:
    """The run reference a KFP row stands for, as the policies see it: engine argo, the
    row's namespace, and the run id label KFP puts on the run's Workflow. The uid is the run
    id, because the Workflow (and its uid) is gone; it keys the database schedule."""
    uuid = str(row.UUID)
    state = str(row.State or "")
    conditions = str(row.Conditions or "")
    return RunRef(
        engine=Engine.ARGO,
        api_version=argo.DEFAULT_API_VERSION,
        kind=argo.KIND,
        namespace=str(row.Namespace or "") or KFP_DEFAULT_NAMESPACE,
        name=str(row.Name or "") or uuid,
        uid=uuid,
        phase=_KFP_PHASES.get(conditions) or _KFP_PHASES.get(state, ""),
        finished_at=datetime.fromtimestamp(int(row.FinishedAtInSec), UTC),
        labels={KFP_RUN_ID_LABEL: uuid},
        kfp_run_id=uuid,
    )


async def finished_kfp_rows(engine: AsyncEngine, after: str, limit: int) -> Sequence[Row[Any]]:
    """The next page of finished runs by run id (keyset pagination: each page is an index
    range scan, however deep into the table it is)."""
    t = _RUN_DETAILS
    query = (
        select(t.c.UUID, t.c.Namespace, t.c.Name, t.c.FinishedAtInSec, t.c.State, t.c.Conditions)
        .where(t.c.FinishedAtInSec > 0, t.c["UUID"] > after)
        .order_by(t.c.UUID)
        .limit(limit)
    )
    async with engine.connect() as conn:
        return (await conn.execute(query)).all()


def database_problem(exc: BaseException) -> str:
    if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        text = one_line(exc.orig)
        if isinstance(exc, sa_exc.ProgrammingError) and "run_details" in text:
            return f"{text} (is database.url KFP's database, e.g. mlpipeline?)"
        return text
    return one_line(exc)


async def count_finished_kfp_rows(engine: AsyncEngine) -> int:
    t = _RUN_DETAILS
    async with engine.connect() as conn:
        count = await conn.scalar(
            select(func.count()).select_from(t).where(t.c.FinishedAtInSec > 0)
        )
    return int(count or 0)
