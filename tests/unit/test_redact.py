"""Credentials in URLs are masked wherever lapse shows one (lapse/config/redact.py)."""

from __future__ import annotations

import logging

import pytest

from lapse.config.redact import RedactingFilter, redact, redact_url
from lapse.edges import health, limits, watch_leases, watch_positions
from lapse.edges.artifacts import captures
from lapse.edges.nats import authenticates
from lapse.embedded.nats_identities import (
    CAPTURES_BUCKET,
    KV_BUCKETS,
    LEASES_BUCKET,
    WATCH_BUCKET,
)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("nats://lapse:s3cret@nats:4222", "nats://lapse:***@nats:4222"),
        ("nats://tok3n@nats:4222", "nats://***@nats:4222"),
        (
            "tls://a:p1@n1:4222,tls://b:p2@n2:4222",
            "tls://a:***@n1:4222,tls://b:***@n2:4222",
        ),
        (
            "postgresql://kfp:pa@ss:w0rd@db:5432/mlpipeline",
            "postgresql://kfp:***@db:5432/mlpipeline",
        ),
        ("postgresql://kfp@db/mlpipeline", "postgresql://kfp@db/mlpipeline"),
        ("mysql://u@db/x?password=hunter2&x=1", "mysql://u@db/x?password=***&x=1"),
        (
            "no answer from NATS at nats://u:pw@h:1 within 10s",
            "no answer from NATS at nats://u:***@h:1 within 10s",
        ),
        ("sqlite:////tmp/lapse.db", "sqlite:////tmp/lapse.db"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_redact_url_keeps_none() -> None:
    assert redact_url(None) is None


def test_the_log_filter_masks_messages_and_tracebacks() -> None:
    try:
        raise RuntimeError("cannot reach nats://lapse:s3cret@h:4222")
    except RuntimeError:
        import sys

        record = logging.LogRecord(
            "x",
            logging.ERROR,
            __file__,
            1,
            "at %s",
            ("nats://lapse:s3cret@h:4222",),
            sys.exc_info(),
        )
    assert RedactingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "s3cret" not in text
    assert "nats://lapse:***@h:4222" in text


def test_a_credential_in_the_url_counts_as_authentication() -> None:
    assert authenticates("nats://u:p@h:4222", None)
    assert authenticates("nats://h1:4222,nats://tok@h2:4222", None)
    assert not authenticates("nats://h:4222", None)


def test_the_buckets_the_identities_grant_are_the_ones_lapse_writes() -> None:
    assert set(KV_BUCKETS) == {limits.BUCKET, health.BUCKET}
    assert WATCH_BUCKET == watch_positions.BUCKET
    assert LEASES_BUCKET == watch_leases.BUCKET
    assert CAPTURES_BUCKET == captures.BUCKET


def test_an_unparseable_database_url_is_not_echoed() -> None:
    from lapse.config.database_url import DatabaseURLError, async_url

    with pytest.raises(DatabaseURLError) as raised:
        async_url("postgresql//kfp:hunter2@db/mlpipeline")  # no colon: not a URL to mask
    assert "hunter2" not in str(raised.value)
