"""Which database errors are retried and which make the run fail (lapse.edges.rows)."""

from __future__ import annotations

import asyncpg
import pymysql
import pytest
from sqlalchemy import exc as sa_exc

from lapse.edges.rows import classify_failure
from lapse.functions.row_reaper import Rejected, Unavailable


def wrapped(kind: type[sa_exc.DBAPIError], orig: Exception) -> sa_exc.DBAPIError:
    return kind("DELETE FROM run_details ...", {}, orig)


@pytest.mark.parametrize(
    ("error", "expected", "words"),
    [
        (ConnectionRefusedError(111, "Connect call failed"), Unavailable, "unreachable"),
        (TimeoutError(), Unavailable, "did not answer in time"),
        (
            wrapped(sa_exc.OperationalError, pymysql.err.OperationalError(2003, "Can't connect")),
            Unavailable,
            "unreachable",
        ),
        (
            wrapped(sa_exc.OperationalError, pymysql.err.OperationalError(1213, "Deadlock")),
            Unavailable,
            "will retry",
        ),
        (
            wrapped(sa_exc.OperationalError, pymysql.err.OperationalError(1054, "Unknown col")),
            Rejected,
            "refused",
        ),
        (
            wrapped(sa_exc.IntegrityError, pymysql.err.IntegrityError(1451, "a foreign key")),
            Rejected,
            "a foreign key",
        ),
        (
            wrapped(sa_exc.DBAPIError, asyncpg.exceptions.DeadlockDetectedError("deadlock")),
            Unavailable,
            "40P01",
        ),
        (
            wrapped(sa_exc.DBAPIError, asyncpg.exceptions.AdminShutdownError("shutting down")),
            Unavailable,
            "57P01",
        ),
        (
            wrapped(
                sa_exc.DBAPIError, asyncpg.exceptions.ForeignKeyViolationError("still referenced")
            ),
            Rejected,
            "23503",
        ),
        (
            wrapped(sa_exc.DBAPIError, asyncpg.exceptions.InvalidTextRepresentationError("bad")),
            Rejected,
            "22P02",
        ),
    ],
)
def test_database_errors_are_retried_or_refused(
    error: BaseException, expected: type[Unavailable | Rejected], words: str
) -> None:
    result = classify_failure(error)

    assert type(result) is expected
    assert words in result.reason


def test_a_dropped_connection_is_retried_whatever_the_error_class() -> None:
    error = wrapped(sa_exc.ProgrammingError, pymysql.err.ProgrammingError(1146, "gone"))
    error.connection_invalidated = True

    assert isinstance(classify_failure(error), Unavailable)


def test_statements_lapse_built_wrongly_are_bugs_not_database_trouble() -> None:
    with pytest.raises(sa_exc.ArgumentError):
        classify_failure(sa_exc.ArgumentError("bad construct"))
