"""One shard of the parameter server, as pure handlers (no sockets).

A `Shard` owns the slice ``shard_of(key, num_shards) == shard_id`` of every
table. The HTTP server (`ps_core.server`) and the in-process transport
(`ps_core.client.LocalTransport`) both call these handlers, so the same checks
and effects hold whichever way a request arrives. Handlers run to completion
without awaiting: one request's effects are never interleaved with another's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import numpy.typing as npt

from . import codec
from .errors import FrameError, InvalidValuesError, TableConflictError, UnknownTableError, WrongShardError
from .hashing import shard_of
from .table import F32, SparseTable, TableConfig

__all__ = ["Shard", "ShardSpec"]


@dataclass(frozen=True)
class ShardSpec:
    """Where a shard sits in the cluster."""

    shard_id: int
    """This shard's number, in ``[0, num_shards)``."""
    num_shards: int
    """How many shards split the key space."""

    def __post_init__(self) -> None:
        if self.num_shards < 1 or not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard id {self.shard_id} not in [0, {self.num_shards})")


class Shard:
    """The tables of one shard and the handlers that read and update them."""

    def __init__(
        self,
        spec: ShardSpec = ShardSpec(0, 1),
        tables: Iterable[TableConfig] = (),
        *,
        dedup_window: int = 4096,
    ) -> None:
        self.spec = spec
        self.tables: dict[str, SparseTable] = {}
        self._dedup_window = dedup_window
        # request_id -> applied count of recent pushes, so that a client's retry
        # of a push whose ack was lost is acknowledged without applying twice.
        self._recent_pushes: OrderedDict[int, int] = OrderedDict()
        self.duplicate_pushes = 0
        """Retried pushes recognised by request id and not applied again."""
        for config in tables:
            self.declare(config)

    # -- tables --------------------------------------------------------------
    def declare(self, config: TableConfig) -> bool:
        """Create a table, or accept an identical re-declaration.

        Returns True when the table was created. A declaration that differs
        from the existing table's is a `TableConflictError`, never an overwrite.
        """
        existing = self.tables.get(config.name)
        if existing is not None:
            if existing.config != config:
                raise TableConflictError(
                    f"table {config.name} exists with {existing.config.to_dict()}, "
                    f"declared again with {config.to_dict()}"
                )
            return False
        self.tables[config.name] = SparseTable(config)
        return True

    def table(self, name: str) -> SparseTable:
        """The table called `name`, or `UnknownTableError`."""
        try:
            return self.tables[name]
        except KeyError:
            raise UnknownTableError(
                f"no table {name!r} on shard {self.spec.shard_id}; declared: {sorted(self.tables)}"
            ) from None

    def _check_owned(self, keys: npt.NDArray[np.uint64]) -> None:
        if self.spec.num_shards == 1 or keys.size == 0:
            return
        wrong = shard_of(keys, self.spec.num_shards) != self.spec.shard_id
        if wrong.any():
            raise WrongShardError(
                f"{int(wrong.sum())} of {keys.size} keys belong to other shards, not shard "
                f"{self.spec.shard_id} of {self.spec.num_shards} (first: {int(keys[wrong][0])})"
            )

    # -- handlers ------------------------------------------------------------
    def handle_pull(self, table: str, keys: npt.NDArray[np.uint64]) -> tuple[F32, int]:
        """Weights of `keys` and the table's open version."""
        t = self.table(table)
        self._check_owned(keys)
        return t.pull(keys), t.version

    def handle_push(
        self,
        table: str,
        keys: npt.NDArray[np.uint64],
        grads: F32,
        *,
        counts: F32 | None = None,
        event_time: float = 0.0,
        request_id: int = 0,
    ) -> tuple[int, int]:
        """Apply a push; returns (distinct keys applied, open version).

        A push whose nonzero `request_id` was applied recently is acknowledged
        with its earlier result and not applied again.
        """
        t = self.table(table)
        if grads.ndim != 2 or grads.shape[1] != t.dim:
            raise InvalidValuesError(
                f"table {table} has dim {t.dim}, the push carries dim "
                f"{grads.shape[1] if grads.ndim == 2 else grads.ndim}"
            )
        self._check_owned(keys)
        # Checked after validation, so a malformed request never reads as a
        # duplicate of an earlier good one.
        if request_id and request_id in self._recent_pushes:
            self.duplicate_pushes += 1
            return self._recent_pushes[request_id], t.version
        applied = t.push(keys, grads, counts=counts, event_time=event_time or None)
        if request_id:
            self._recent_pushes[request_id] = applied
            if len(self._recent_pushes) > self._dedup_window:
                self._recent_pushes.popitem(last=False)
        return applied, t.version

    def handle_frame(
        self, body: bytes | bytearray | memoryview, expect_op: int | None = None
    ) -> bytes:
        """Decode a pull or push frame, apply it, encode the reply."""
        frame = codec.decode(body, expect_op)
        if frame.op == codec.Op.PULL:
            assert frame.keys is not None
            weights, version = self.handle_pull(frame.table, frame.keys)
            return codec.encode_weights(frame.table, weights, version)
        if frame.op == codec.Op.PUSH:
            assert frame.keys is not None and frame.values is not None
            applied, version = self.handle_push(
                frame.table,
                frame.keys,
                frame.values,
                counts=frame.counts,
                event_time=frame.event_time,
                request_id=frame.request_id,
            )
            return codec.encode_ack(frame.table, applied, version)
        raise FrameError(f"op {frame.op} is a reply, not a request")

    def stats(self) -> dict[str, Any]:
        """Features, bytes and call counts per table (JSON-ready)."""
        return {
            "shard_id": self.spec.shard_id,
            "num_shards": self.spec.num_shards,
            "duplicate_pushes": self.duplicate_pushes,
            "tables": {
                name: {
                    "features": len(t),
                    "bytes": t.memory_bytes(),
                    "pushes": t.pushes,
                    "pulls": t.pulls,
                    "version": t.version,
                    "config": t.config.to_dict(),
                }
                for name, t in self.tables.items()
            },
        }
