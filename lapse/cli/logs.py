"""How lapse's log lines look: UTC timestamps, and `--log-format json` (or
`LAPSE_LOG_FORMAT=json`) for a log pipeline, one JSON object a line.

A line may carry structured fields (`extra={"fields": {...}}`, e.g. each deletion's kind,
namespace, name, uid, policy and lateness): JSON puts them beside the message; text has
them in the message already.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Final

LOG_FORMATS: Final = ("text", "json")
LOG_FORMAT_ENV: Final = "LAPSE_LOG_FORMAT"
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def default_log_format() -> str:
    return os.environ.get(LOG_FORMAT_ENV, "").strip().lower() or "text"


def _utc_time(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`2026-11-25T13:19:01.123Z INFO lapse: ...`: RFC 3339 in UTC, as the events carry."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_time(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc_time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update({k: v for k, v in fields.items() if k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(log_format: str, *, debug: bool) -> None:
    """Replace whatever handlers an import installed (func-python calls basicConfig when
    imported, which made lapse's own format a no-op: no timestamps)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO, handlers=[handler], force=True
    )
