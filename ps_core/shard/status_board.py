"""The status board: the latest status each source reported (`StatusBoard`).

Each source, e.g. each training worker, reports its status (a JSON object)
to shard 0 (`PSClient.report_status`), so that processes which do not train
(the API, its metrics) can read the workers' progress.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import orjson

from ..errors import StatusError
from ..store.board import check_report

__all__ = ["StatusBoard"]


class StatusBoard:
    """The latest status of the `max_sources` sources that reported most recently."""

    def __init__(self, max_sources: int = 256) -> None:
        self._max_sources = max_sources
        # source -> (received_at, status), least recently reported first.
        self._statuses: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def report(self, source: object, status: object, *, now: float | None = None) -> dict[str, Any]:
        """Store `status` (a JSON object) as the latest of `source`.

        An older source is forgotten first beyond `max_sources`. Returns the
        stored entry's summary. Raises `StatusError` (nothing stored) unless
        `source` and `status` match the board's schema (`ps_core.store.board`):
        a short printable source, a closed object of bounded counts and
        times, at most `MAX_STATUS_BYTES` encoded.
        """
        try:
            encoded = orjson.dumps(status)
        except TypeError as exc:  # orjson's error for non-string keys, objects, huge ints
            raise StatusError(f"status is not JSON: {exc}") from None
        check_report(source, status, len(encoded))
        if not isinstance(source, str):  # check_report refused any other: narrowed for the type checker
            raise StatusError(f"source must be a string, got {type(source).__name__}")
        received = time.time() if now is None else now
        # Stored as decoded from its encoding: a detached copy, as over HTTP.
        self._statuses[source] = (received, orjson.loads(encoded))
        self._statuses.move_to_end(source)
        while len(self._statuses) > self._max_sources:
            self._statuses.popitem(last=False)
        return {"source": source, "received_at": received, "sources": len(self._statuses)}

    def entries(self) -> list[dict[str, Any]]:
        """``{"source", "received_at", "status"}`` per source, the least
        recently reported first (JSON-ready)."""
        return [{"source": src, "received_at": at, "status": status} for src, (at, status) in self._statuses.items()]
