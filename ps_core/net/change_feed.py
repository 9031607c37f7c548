"""A geo worker's questions to the shards' change logs: which rows of its
local copy other workers changed since its last round.

Per table and shard it keeps the log's incarnation and sequence number of
the last answer, and the request ids of its own pushes since (the shards
leave those out). `read` asks every shard about every table, concurrently,
and returns the keys changed, or None when any answer was incomplete (the
log no longer reached back, or the shard restarted or was restored): the
worker then reads every row again, as it would without a log.

Shards that predate the log refuse the question (an unknown op over the
RPC, an unknown route over HTTP): the feed says so in one log line and
answers None from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from ..errors import FrameError, PSError
from ..hashing import U64
from .client import PSClient, fan_out

__all__ = ["ChangeFeed"]

log = logging.getLogger("ctrps.geo")


class ChangeFeed:
    """The changed keys of a geo model's `tables`, round by round."""

    def __init__(self, client: PSClient, tables: Sequence[str]) -> None:
        self.client = client
        self.tables = list(tables)
        self.supported = True
        """False once a shard refused the question (a shard older than the log)."""
        self.incomplete = 0
        """Reads answered None: every row to be read again."""
        self.changed_keys = 0
        """Keys the shards reported changed by others (summed over tables and shards)."""
        self._cursors: dict[str, list[tuple[int, int]]] = {}
        self._own: dict[str, list[int]] = {}
        self._answered = False
        self._logged_at = -float("inf")
        self.reset()

    LOG_EVERY_S = 60.0
    """Incomplete answers after a complete one are logged at most this often."""

    def reset(self) -> None:
        """Forget every answer (the worker's copy was dropped)."""
        n = self.client.num_shards
        self._cursors = {t: [(0, 0)] * n for t in self.tables}
        self._own = {t: [] for t in self.tables}
        self._answered = False

    def pushed(self, table: str, request_id: int) -> None:
        """Note a push of this worker's to `table` under `request_id`."""
        self._own[table].append(request_id)

    async def read(self) -> U64 | None:
        """The keys other workers changed (or shards removed) since the last
        read, distinct; None: take every row as changed."""
        if not self.supported:
            self.incomplete += 1
            return None
        try:
            answers = await fan_out([self.client.changes(t, self._cursors[t], self._own[t]) for t in self.tables])
        except (FrameError, PSError) as exc:
            if not _refused_as_unknown(exc):
                raise
            self.supported = False
            log.warning(
                "shards keep no geo change log (older than this worker): every row is read again each round",
                extra={"fields": {"error": str(exc)}},
            )
            self.incomplete += 1
            return None
        complete = True
        parts: list[U64] = []
        for t, per_shard in zip(self.tables, answers):
            self._cursors[t] = [(a.incarnation, a.seq) for a in per_shard]
            self._own[t] = []
            for a in per_shard:
                complete &= a.complete
                parts.append(a.keys)
        if not complete:
            self.incomplete += 1
            # A copy's first answer is always incomplete (nothing asked
            # before); later ones mean a shard restarted or a log too small.
            now = time.monotonic()
            if self._answered and now - self._logged_at >= self.LOG_EVERY_S:
                self._logged_at = now
                log.warning(
                    "geo change log answered incomplete: every row of the copy is read again "
                    "(a shard restarted, was restored or took slots moved to it, or its --geo-change-log-keys "
                    "no longer reached back)",
                    extra={"fields": {"incomplete": self.incomplete}},
                )
            return None
        self._answered = True
        keys: U64 = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)
        self.changed_keys += int(keys.size)
        return keys


def _refused_as_unknown(exc: Exception) -> bool:
    """Whether a shard refused the question as one it does not know: an
    unknown op over the RPC, or a route its HTTP app lacks (an untyped 404
    or 405; a typed error such as ``unknown_table`` is the shard's answer
    and is raised as it is)."""
    if isinstance(exc, FrameError):
        return "unknown op" in exc.detail
    return type(exc) is PSError and getattr(exc, "status", None) in (404, 405)
