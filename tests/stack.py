"""The real servers the tests run against, and the databases they create.

Every server is started by lapse's own embedded launchers (the code `lapse up` uses), on
free loopback ports with state in a temporary directory. Nothing here skips: if a server
cannot start, the fixture errors with the server's own log lines.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import make_url

from lapse.edges.database import create_engine
from lapse.events.timeutil import format_rfc3339

T = TypeVar("T")

# Defaults match scripts/databases.sh, which CI runs before the tests.
POSTGRES_ADMIN_URL = os.environ.get(
    "LAPSE_TEST_POSTGRES_URL", "postgresql://lapse_test:lapse_test@127.0.0.1:5432/postgres"
)
MYSQL_ADMIN_URL = os.environ.get(
    "LAPSE_TEST_MYSQL_URL", "mysql://lapse_test:lapse_test@127.0.0.1:3306/mysql"
)


@dataclass(frozen=True)
class Database:
    kind: str  # "postgresql" | "mysql"
    url: str  # a plain URL; lapse.edges.database picks the async driver


@asynccontextmanager
async def scratch_database(kind: str) -> AsyncIterator[Database]:
    """A database created for this test session and dropped afterwards."""
    admin_url = POSTGRES_ADMIN_URL if kind == "postgresql" else MYSQL_ADMIN_URL
    name = f"lapse_test_{secrets.token_hex(4)}"
    admin = create_engine(admin_url)
    try:
        async with admin.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text(f"CREATE DATABASE {name}"))
    except Exception as exc:
        await admin.dispose()
        raise RuntimeError(
            f"cannot reach {kind} at {make_url(admin_url).render_as_string(hide_password=True)}"
            " - run scripts/databases.sh (make databases)"
        ) from exc
    try:
        yield Database(kind, make_url(admin_url).set(database=name).render_as_string(False))
    finally:
        async with admin.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            if kind == "postgresql":
                await conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            else:
                await conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        await admin.dispose()


async def wait_for(
    predicate: Callable[[], Awaitable[T]], timeout: float = 30.0, interval: float = 0.05
) -> T:
    """Poll an async predicate until it returns something truthy; fail after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def expired_workflow(name: str, finished_at: datetime) -> dict[str, Any]:
    """A finished Workflow, as Argo leaves it, whose 1 s TTL ran out long ago."""
    stamp = format_rfc3339(finished_at)
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true"},
            "annotations": {"lapse.dev/ttl": "1s"},
        },
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Succeeded", "startedAt": stamp, "finishedAt": stamp},
    }
