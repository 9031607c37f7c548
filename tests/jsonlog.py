"""Reading the JSON log lines a process wrote (``--log-format json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

__all__ = ["read_json_lines"]


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects among `path`'s lines; other lines are skipped."""
    out = []
    for line in path.read_bytes().splitlines():
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
