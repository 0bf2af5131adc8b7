"""JSON decoding that fails only with ValueError.

`json.loads` raises RecursionError for deeply nested input (`[[[[...`), which is an
easy way for one hostile message to escape a handler's error path.
"""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str | bytes) -> Any:
    """Decode RFC 8259 JSON text; ValueError (with a short reason) for anything else."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; RFC 8259 and every other peer do not.
    raise ValueError(f"not valid JSON: {name} is not a JSON number")


def is_json_media_type(content_type: str) -> bool:
    """`application/json`, `text/json` or any `+json` suffix, parameters ignored."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")
