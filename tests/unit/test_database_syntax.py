"""The configuration's check of `database.url` (without SQLAlchemy: only the row-reaper's
image carries it) answers as SQLAlchemy's parse and the database edge's driver choice do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from lapse.config.database_syntax import DatabaseURLError, drivername, parses
from lapse.config.database_url import async_url

EXAMPLES = [
    "postgresql://kfp:secret@db:5432/mlpipeline",
    "mysql://root@mariadb/mlpipeline?charset=utf8mb4",
    "sqlite:///tmp/lapse.db",
    "sqlite://",
    "postgresql+psycopg://u:p@[::1]:5432/db",
    "oracle://scott:tiger@db/orcl",
    "oracle+cx_oracle://scott:tiger@db/orcl",
    "postgresql://u:p@db:port/db",
    "postgresql://:",
    "postgresql://u:p@db:/db",
    "postgresql//kfp:hunter2@db/mlpipeline",
    "::not a url::",
    "",
]


def sqlalchemy_parses(url: str) -> bool:
    try:
        make_url(url)
    except Exception:
        return False
    return True


def edge_driver(url: str) -> str | None:
    try:
        return async_url(url).drivername
    except DatabaseURLError:
        return None


def syntax_driver(url: str) -> str | None:
    try:
        return drivername(url)
    except DatabaseURLError:
        return None


@pytest.mark.parametrize("url", EXAMPLES)
def test_the_examples_parse_and_map_as_sqlalchemy_does(url: str) -> None:
    assert parses(url) == sqlalchemy_parses(url)
    assert syntax_driver(url) == edge_driver(url)


@given(
    st.from_regex(
        r"(postgresql|mysql|sqlite|oracle|pg\+asyncpg|x)?(://)?[a-z:@/?\[\]=.0-9%-]{0,30}",
        fullmatch=True,
    )
)
def test_any_text_parses_and_maps_as_sqlalchemy_does(url: str) -> None:
    assert parses(url) == sqlalchemy_parses(url)
    assert syntax_driver(url) == edge_driver(url)
