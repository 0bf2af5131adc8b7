"""The database connection helper: SQLAlchemy 2.0 async engines for every supported URL.

Every statement is counted (`lapse.database.statements`, and per deletion) and, inside a
trace, is a CLIENT span: a child of the row-reaper's span. Hooked on SQLAlchemy's cursor
events rather than through opentelemetry-instrumentation-sqlalchemy, which would also make
a root trace of every statement run outside a handling (start-up schema reflection) and
can instrument only one engine per process.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Final

from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, ExceptionContext
from sqlalchemy.engine.interfaces import DBAPICursor, ExecutionContext
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from lapse.config import async_url
from lapse.config.schema import DATABASE_CONNECT_TIMEOUT, DATABASE_POOL_TIMEOUT
from lapse.telemetry import client_span, count_database_statement, end_client_span
from lapse.telemetry.names import (
    DB_COLLECTION,
    DB_NAMESPACE,
    DB_OPERATION,
    DB_QUERY,
    DB_SYSTEM,
    SERVER_ADDRESS,
    SERVER_PORT,
)

# lapse's statements come from SQLAlchemy Core, so the table follows the first keyword in
# a known shape; this names spans, it is not a SQL parser.
_TABLE: Final = re.compile(
    r"^\s*(?:DELETE\s+FROM|INSERT\s+INTO|UPDATE|SELECT\b.*?\bFROM)\s+[`\"]?([\w.]+)",
    re.IGNORECASE | re.DOTALL,
)
_QUERY_LIMIT: Final = 2048
_SPAN: Final = "_lapse_span"


# Each driver's name for its connect timeout: asyncpg's bounds the whole connect (default
# 60 s), aiomysql's the TCP connect (default none). The row store's statement_timeout
# bounds the rest of a call, the handshake included.
_CONNECT_TIMEOUT_ARG: Final = {"postgresql": "timeout", "mysql": "connect_timeout"}


def create_engine(
    url: str | URL,
    *,
    pool_size: int = 5,
    connect_timeout: timedelta = DATABASE_CONNECT_TIMEOUT,
    pool_timeout: timedelta = DATABASE_POOL_TIMEOUT,
) -> AsyncEngine:
    """An engine for `url`. A server that never answers holds a connect no longer than
    `connect_timeout`, and a caller waits for a pooled connection no longer than
    `pool_timeout` (lapse.yaml's database.connect_timeout and database.pool_timeout)."""
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        engine = create_async_engine(target)
    else:
        engine = create_async_engine(
            target,
            pool_size=pool_size,
            pool_pre_ping=True,
            pool_timeout=pool_timeout.total_seconds(),
            connect_args=_connect_args(target, connect_timeout),
        )
    trace_statements(engine)
    return engine


def _connect_args(url: URL, connect_timeout: timedelta) -> dict[str, Any]:
    name = _CONNECT_TIMEOUT_ARG.get(url.get_backend_name())
    return {} if name is None else {name: connect_timeout.total_seconds()}


def trace_statements(engine: AsyncEngine) -> None:
    """Count every statement of `engine`, and make it a CLIENT span inside a trace."""
    url = engine.url
    common: dict[str, AttributeValue] = {DB_SYSTEM: engine.dialect.name}
    if url.database:
        common[DB_NAMESPACE] = url.database
    if url.host:
        common[SERVER_ADDRESS] = url.host
    if url.port:
        common[SERVER_PORT] = url.port

    def before(
        conn: Connection,
        cursor: DBAPICursor,
        statement: str,
        parameters: Any,
        context: ExecutionContext | None,
        executemany: bool,
    ) -> None:
        words = statement.split(None, 1)
        operation = words[0].upper() if words else "UNKNOWN"
        count_database_statement(operation)
        table = _TABLE.match(statement)
        attributes = {**common, DB_OPERATION: operation, DB_QUERY: statement[:_QUERY_LIMIT]}
        if table:
            attributes[DB_COLLECTION] = table.group(1)
        name = f"{operation} {table.group(1)}" if table else operation
        span = client_span(name, attributes)
        if span is not None and context is not None:
            setattr(context, _SPAN, span)

    def after(
        conn: Connection,
        cursor: DBAPICursor,
        statement: str,
        parameters: Any,
        context: ExecutionContext | None,
        executemany: bool,
    ) -> None:
        end_client_span(_pop_span(context))

    def failed(exception_context: ExceptionContext) -> None:
        error = type(exception_context.original_exception).__name__
        end_client_span(_pop_span(exception_context.execution_context), error=error)

    sync_engine = engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", before)
    event.listen(sync_engine, "after_cursor_execute", after)
    event.listen(sync_engine, "handle_error", failed)


def _pop_span(context: ExecutionContext | None) -> Span | None:
    span = getattr(context, _SPAN, None) if context is not None else None
    if span is not None:
        delattr(context, _SPAN)
    return span if isinstance(span, Span) else None
