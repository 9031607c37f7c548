"""The status board's schema: what a source may report (`Shard.report_status`).

Workers report one JSON object per window (`app.status.worker_status`); the
API and its metrics read the board back (`app.status.summarize`). A report
is stored only when it matches `STATUS_SCHEMA`, a closed JSON Schema with
bounded sizes and values, so nothing stored can break a reader:

- counts are JSON integers in ``[0, 2**53)`` (exact as a float: what a
  dashboard or Prometheus reads back), seconds and times numbers in
  ``[0, 1e10]``;
- partition keys are ASCII digits without a leading zero, below 10**9
  (``"3"``, never ``"³"``, ``"03"`` or ``" 3"``), at most `MAX_PARTITIONS`
  of them; reasons and other names are printable ASCII of at most 64
  characters (they become metric labels), at most 64 of them;
- the whole status is at most `MAX_STATUS_BYTES` encoded and at most three
  levels deep (the schema is closed: no field outside it).

The API's OpenAPI document and the shard's publish this very schema
(`app.openapi`, `ps_core.net.shard_openapi`).
"""

from __future__ import annotations

from typing import Any

from ..errors import StatusError
from ..schema import validate

__all__ = [
    "STATUS_SCHEMA",
    "SOURCE_SCHEMA",
    "MAX_STATUS_BYTES",
    "MAX_SOURCE_CHARS",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MAX_PARTITIONS",
    "PARTITION_KEY",
    "check_report",
]

MAX_STATUS_BYTES = 64 * 1024
"""Largest status object the board stores (encoded as JSON)."""
MAX_SOURCE_CHARS = 200
"""Longest source name on the board."""
MAX_COUNT = 2**53 - 1
"""Largest count a status may carry: every integer up to it is exact as a float."""
MAX_SECONDS = 1e10
"""Largest time (seconds since the epoch: the year 2286) or duration a status may carry."""
MAX_PARTITIONS = 4096
"""Most partitions one status may name."""
MAX_NAMES = 64
"""Most reasons (or fields of a window) one map of a status may hold."""

PARTITION_KEY = "^(0|[1-9][0-9]{0,8})$"
"""A partition number as a JSON object key: ASCII digits, no sign or leading zero."""

_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[!-~]+$"}
_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}
_SECONDS = {"type": "number", "minimum": 0, "maximum": MAX_SECONDS}
_COUNTS_BY = {
    "type": "object",
    "maxProperties": MAX_NAMES,
    "propertyNames": _NAME,
    "additionalProperties": _COUNT,
}

SOURCE_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_SOURCE_CHARS,
    "pattern": "^[!-~]+$",
    "description": "Who reports, e.g. a worker's host-pid-random id: printable ASCII, no blanks.",
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What app.status.worker_status reports (every field optional, no other field).",
    "additionalProperties": False,
    "properties": {
        "kind": {"type": "string", "enum": ["worker"]},
        "update_mode": _NAME,
        "reported_at": _SECONDS,
        "started_at": _SECONDS,
        "windows": _COUNT,
        "records_consumed": _COUNT,
        "events_trained": _COUNT,
        "dead_letters": _COUNT,
        "dead_letters_by_reason": _COUNTS_BY,
        "commits": _COUNT,
        "failed_commits": _COUNT,
        "stale_offsets": {
            "type": "object",
            "description": "Partitions whose resume offset was not applied as given, by reason and action.",
            "maxProperties": MAX_NAMES,
            "propertyNames": _NAME,
            "additionalProperties": _COUNTS_BY,
        },
        "outages": _COUNT,
        "outage_seconds": _SECONDS,
        "windows_replayed": _COUNT,
        "last_window": {
            "type": "object",
            "description": "The last window's figures (consumers.worker.WindowReport.fields, and seconds).",
            "maxProperties": MAX_NAMES,
            "propertyNames": _NAME,
            "additionalProperties": {
                "type": ["number", "string", "null"],
                "minimum": -1e15,
                "maximum": 1e15,
                "maxLength": 8 * MAX_PARTITIONS,
            },
        },
        "lag_by_partition": {
            "type": "object",
            "description": "Records behind per partition (keys: partition numbers in ASCII digits).",
            "maxProperties": MAX_PARTITIONS,
            "propertyNames": {"type": "string", "pattern": PARTITION_KEY},
            "additionalProperties": _COUNT,
        },
        "window_seconds": {
            "type": "object",
            "description": "The histogram of window durations (app.status.SecondsHistogram).",
            "required": ["bounds", "counts", "sum", "count"],
            "additionalProperties": False,
            "properties": {
                "bounds": {"type": "array", "maxItems": 64, "items": _SECONDS},
                "counts": {"type": "array", "maxItems": 65, "items": _COUNT},
                "sum": {"type": "number", "minimum": 0, "maximum": 1e15},
                "count": _COUNT,
            },
        },
    },
}


def check_report(source: object, status: object, encoded_size: int) -> None:
    """`StatusError` (400) unless `source` and `status` (a decoded JSON
    object of `encoded_size` bytes) match the board's schema; its detail
    names the first few violations."""
    problems = validate(source, SOURCE_SCHEMA, path="source")
    if not problems and encoded_size > MAX_STATUS_BYTES:
        problems = [f"status of {encoded_size} bytes exceeds {MAX_STATUS_BYTES}"]
    if not problems:
        problems = validate(status, STATUS_SCHEMA, path="status")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise StatusError("; ".join(problems[:3]) + more)
