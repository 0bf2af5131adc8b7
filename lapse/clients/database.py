"""The database connection helper: SQLAlchemy 2.0 async engines for every supported URL."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

# Users write the URL they know (postgresql://, mysql://, sqlite:///); lapse needs the async
# driver for each, so plain dialects are mapped to one. An explicit driver is kept.
_ASYNC_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "mysql": "mysql+aiomysql",
    "mariadb": "mysql+aiomysql",
    "sqlite": "sqlite+aiosqlite",
}


class DatabaseURLError(ValueError):
    """The configured database URL cannot be used."""


def async_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except Exception as exc:  # SQLAlchemy raises ArgumentError for anything unparseable
        raise DatabaseURLError(f"not a database URL: {exc}") from exc
    if "+" in parsed.drivername:
        return parsed
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    if driver is None:
        supported = ", ".join(sorted(_ASYNC_DRIVERS))
        raise DatabaseURLError(f"unsupported database '{parsed.drivername}' (use {supported})")
    return parsed.set(drivername=driver)


def create_engine(url: str | URL, *, pool_size: int = 5) -> AsyncEngine:
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        return create_async_engine(target)
    return create_async_engine(target, pool_size=pool_size, pool_pre_ping=True)
