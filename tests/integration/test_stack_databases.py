"""PostgreSQL and MariaDB work through lapse's own database helper."""

from __future__ import annotations

from sqlalchemy import Column, MetaData, String, Table, delete, insert, select

from lapse.edges.database import create_engine
from tests.stack import Database


async def test_create_insert_delete(database: Database) -> None:
    engine = create_engine(database.url)
    metadata = MetaData()
    runs = Table(
        "stack_runs",
        metadata,
        Column("uuid", String(64), primary_key=True),
        Column("name", String(128)),
    )
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(
                insert(runs), [{"uuid": f"u{i}", "name": f"run-{i}"} for i in range(3)]
            )
        async with engine.begin() as conn:
            result = await conn.execute(delete(runs).where(runs.c.uuid == "u1"))
            assert result.rowcount == 1
            again = await conn.execute(delete(runs).where(runs.c.uuid == "u1"))
            assert again.rowcount == 0
        async with engine.connect() as conn:
            left = (await conn.execute(select(runs.c.uuid).order_by(runs.c.uuid))).scalars().all()
        assert left == ["u0", "u2"]
        assert engine.dialect.name == database.kind
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.drop_all)
        await engine.dispose()
