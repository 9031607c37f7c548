"""A geo worker's local copy of the model: rows trained locally, their
differences pushed to the shards every few mini-batches.

In geo mode (Geo-SGD) the shards hold weights only and add the deltas
workers push (`ps_core.store.optim.AddDeltas`); each worker trains its own
copy with the model's optimizer, whose state never leaves it. Per row the
copy keeps the optimizer's row, the ``base`` weights last read from the
shards, and whether it was trained since the last push.

A *round* is the mini-batches between two pushes. At a round's end the
worker pushes ``(local − base) · scale`` for every row it trained whose
weights moved (with the shows and clicks it saw since its last push) and reads
back the shards' merged weights, which become both the row's weights and its
new base (`merge`). Other rows may have been changed by other workers
since they were read: `end_round` marks stale the keys the shards' change
logs report changed (`ps_core.net.change_feed`), or every row but those
just merged when there is no such report, and the next mini-batch that
meets a stale row pulls it again (`locate` says which). So a worker sees
any key another worker changed within one round of meeting it, and pulls
only keys it uses.

Memory is bounded: past ``max_rows`` rows, `end_round` drops the least
recently used ones down to nine tenths of it (their optimizer state starts
afresh if they come back; the shows and clicks an unmoved row held unsent go
with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..rows import put_rows
from ..store.index import KeyIndex
from ..store.optim import FTRL, FTRLMixture, Optimizer, make_optimizer
from ..store.table_config import TableConfig

__all__ = ["GeoCopy", "Deltas"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


class Deltas:
    """What a round pushes: the trained rows, their keys, each table's
    scaled differences, and the shows and clicks they saw."""

    __slots__ = ("rows", "keys", "values", "counts")

    def __init__(self, rows: I64, keys: U64, values: dict[str, F32], counts: F32) -> None:
        self.rows = rows
        self.keys = keys
        self.values = values
        self.counts = counts


class GeoCopy:
    """The rows of a model's tables one geo worker trains locally.

    Every table of a model is keyed by the same feature ids (a plan's
    distinct keys), so one `KeyIndex` numbers the rows of all of them.
    """

    def __init__(self, tables: Sequence[TableConfig], *, max_rows: int = 1_000_000) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.max_rows = max_rows
        self.dims = {t.name: t.dim for t in tables}
        self.optimizers: dict[str, Optimizer] = {t.name: make_optimizer(t.optimizer) for t in tables}
        self.index = KeyIndex()
        self.rows: dict[str, F32] = {}
        self.base: dict[str, F32] = {}
        self.synced = np.zeros(0, dtype=bool)
        """Rows read from (or merged with) the shards in this round."""
        self.trained = np.zeros(0, dtype=bool)
        """Rows trained since the last push."""
        self.counts = np.zeros((0, 2), dtype=np.float32)
        """Shows and clicks each row saw since the last push."""
        self.used = np.zeros(0, dtype=np.int64)
        """The round each row was last trained in (what `end_round` drops by)."""
        self.rounds = 0
        self.pulled_keys = 0
        """Keys read from the shards before training (new or stale)."""
        self.pushed_keys = 0
        """Keys whose differences were pushed."""
        self.unmoved_keys = 0
        """Trained keys not pushed, their weights unmoved (`deltas`)."""
        self.dropped_rows = 0
        """Least recently used rows dropped to stay under `max_rows`."""
        self.refreshed_rows = 0
        """Rows marked stale because the shards reported them changed."""
        self.full_refreshes = 0
        """Rounds that ended with every row marked stale (no complete report)."""
        self._probed: tuple[int, I64] = (-1, np.zeros(0, dtype=np.int64))
        # Per table, what `weights` gathered and derived for `train`.
        self._gathered: dict[str, tuple[I64, F32, tuple[F32, F32] | None]] = {}
        self._resize(1024)

    def _resize(self, capacity: int) -> None:
        """Grow every per-row array to `capacity` rows (kept contents)."""
        for name, dim in self.dims.items():
            width = self.optimizers[name].width(dim)
            self.rows[name] = _grown(self.rows.get(name), (capacity, width))
            self.base[name] = _grown(self.base.get(name), (capacity, dim))
        self.synced = _grown(self.synced, (capacity,))
        self.trained = _grown(self.trained, (capacity,))
        self.counts = _grown(self.counts, (capacity, 2))
        self.used = _grown(self.used, (capacity,))

    def __len__(self) -> int:
        return self.index.size

    def nbytes(self) -> int:
        """Bytes the copy holds (arrays at capacity, and the index)."""
        arrays = [*self.rows.values(), *self.base.values(), self.synced, self.trained, self.counts, self.used]
        return int(sum(a.nbytes for a in arrays)) + self.index.nbytes()

    def locate(self, keys: U64) -> tuple[I64, npt.NDArray[np.bool_]]:
        """The row of each distinct key (-1: absent) and which keys must be
        read from the shards first (absent, or stale this round)."""
        rows, free = self.index.probe(keys)
        # Where absent keys would go, for `take`'s insert while nothing moved.
        self._probed = (self.index.mutations, free)
        need = rows < 0
        known = ~need
        need[known] = ~self.synced[rows[known]]
        return rows, need

    def take(self, keys: U64, rows: I64, need: npt.NDArray[np.bool_], pulled: dict[str, F32]) -> I64:
        """Take the shards' weights `pulled` (per table, for ``keys[need]``,
        `keys` distinct, `rows` and `need` as `locate` gave them): new rows
        start from them with fresh optimizer state, stale rows have their
        weights replaced and keep their state. Returns every key's row."""
        self._gathered = {}  # rows change below
        got = rows[need]
        fresh = got < 0
        if fresh.any():
            mutations, free = self._probed
            absent = np.flatnonzero(need)[fresh]
            hint = free[absent] if mutations == self.index.mutations and free.size == keys.size else None
            got[fresh] = self.index.insert_absent(keys[absent], hint)[0]
            if self.index.num_rows > self.synced.size:
                self._resize(max(self.index.num_rows, 2 * self.synced.size))
            new_rows = got[fresh]
            self.trained[new_rows] = False
            self.counts[new_rows] = 0
        for name, opt in self.optimizers.items():
            w = np.ascontiguousarray(pulled[name], dtype=np.float32)
            put_rows(self.base[name], got, w)
            table = self.rows[name]
            if fresh.any():
                put_rows(table, got[fresh], opt.rows_from_weights(w[fresh]))
            old = got[~fresh]
            if old.size:
                block = table.take(old, axis=0)
                opt.set_weights(block, w[~fresh])
                put_rows(table, old, block)
        self.synced[got] = True
        self.pulled_keys += int(got.size)
        out = rows.copy()
        out[need] = got
        return out

    def weights(self, rows: I64) -> dict[str, F32]:
        """Each table's current local weights (n, dim) of `rows`.

        What it gathered (and FTRL derived) is kept for a `train` of the
        same `rows` array that follows, which then neither gathers nor
        derives again (the rows cannot change in between)."""
        out: dict[str, F32] = {}
        self._gathered = {}
        for name, opt in self.optimizers.items():
            block = self.rows[name].take(rows, axis=0)
            derived = opt.derive(block, self.dims[name]) if isinstance(opt, (FTRL, FTRLMixture)) else None
            w = derived[0].copy() if derived is not None else opt.weights(block, self.dims[name])
            out[name] = np.ascontiguousarray(w)
            self._gathered[name] = (rows, block, derived)
        return out

    def train(self, rows: I64, grads: dict[str, F32], counts: F32) -> None:
        """One optimizer step on distinct `rows` with each table's gradients
        (summed per key), counting their shows and clicks."""
        gathered, self._gathered = self._gathered, {}
        for name, opt in self.optimizers.items():
            g = np.ascontiguousarray(grads[name], dtype=np.float32)
            kept = gathered.get(name)
            if kept is not None and kept[0] is rows:
                block, derived = kept[1], kept[2]
            else:
                block, derived = self.rows[name].take(rows, axis=0), None
            if derived is not None and isinstance(opt, (FTRL, FTRLMixture)):
                opt.step(block, g, derived)
            else:
                opt.step(block, g)
            put_rows(self.rows[name], rows, block)
        self.trained[rows] = True
        self.used[rows] = self.rounds
        put_rows(self.counts, rows, self.counts.take(rows, axis=0) + counts)

    def deltas(self, scale: float) -> Deltas:
        """The round's push: ``(local − base) · scale`` of every trained row
        whose weights moved in some table.

        A trained row that did not move (FTRL's L1 holds most rare ids at
        exactly 0) is not sent: it has nothing to add, and the shards need
        no row for it. Its shows and clicks wait in the copy and travel with
        its first move; it is not merged, so it is stale next round."""
        trained = np.flatnonzero(self.trained[: self.index.num_rows])
        s = np.float32(scale)
        diffs = {
            name: opt.weights(self.rows[name].take(trained, axis=0), self.dims[name])
            - self.base[name].take(trained, axis=0)
            for name, opt in self.optimizers.items()
        }
        moved = np.zeros(trained.size, dtype=bool)
        for d in diffs.values():
            moved |= (d != 0).any(axis=1)
        self.trained[trained[~moved]] = False
        self.unmoved_keys += int(trained.size - moved.sum())
        rows = trained[moved]
        values = {name: d[moved] * s for name, d in diffs.items()}
        return Deltas(rows, self.index.row_keys[rows], values, self.counts.take(rows, axis=0))

    def merge(self, rows: I64, merged: dict[str, F32]) -> None:
        """The shards' weights after the push of `rows`: each row's weights
        and its new base (its optimizer state kept)."""
        self._gathered = {}
        for name, opt in self.optimizers.items():
            w = np.ascontiguousarray(merged[name], dtype=np.float32)
            block = self.rows[name].take(rows, axis=0)
            opt.set_weights(block, w)
            put_rows(self.rows[name], rows, block)
            put_rows(self.base[name], rows, w)
        self.trained[rows] = False
        put_rows(self.counts, rows, np.zeros((rows.size, 2), dtype=np.float32))
        self.pushed_keys += int(rows.size)

    def end_round(self, merged_rows: I64, changed: U64 | None) -> None:
        """Close a round: the rows of the keys `changed` since the last round
        by other workers (the shards' report, asked after this round's
        merge) are stale until read again; with no report (None), every row
        but those just merged is. Past `max_rows`, the least recently
        trained rows go, down to nine tenths of it."""
        self.rounds += 1
        if changed is None:
            self.synced[:] = False
            self.synced[merged_rows] = True
            self.full_refreshes += 1
        elif changed.size:
            rows = self.index.lookup(changed)
            rows = rows[rows >= 0]
            self.synced[rows] = False
            self.refreshed_rows += int(rows.size)
        if self.index.size > self.max_rows:
            live = np.flatnonzero(self.index.row_live)
            excess = live.size - int(0.9 * self.max_rows)
            # The `excess` least recently trained rows (ties: any of them).
            oldest = live[np.argpartition(self.used[live], excess - 1)[:excess]]
            self.index.delete(self.index.row_keys[oldest], distinct=True)
            self.synced[oldest] = False
            self.trained[oldest] = False
            self.dropped_rows += int(oldest.size)

    def clear(self) -> None:
        """Forget every row (after a window failed part-way or the shards
        were rewound: the bases no longer say what the shards hold)."""
        self.index = KeyIndex()
        self._probed = (-1, np.zeros(0, dtype=np.int64))
        self._gathered = {}
        self.synced[:] = False
        self.trained[:] = False
        self.counts[:] = 0


def _grown(a: npt.NDArray[Any] | None, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """`a` grown to `shape` (rows appended, zero), or a new zero array."""
    dtype = np.float32 if a is None else a.dtype
    out = np.zeros(shape, dtype=dtype)
    if a is not None:
        out[: a.shape[0]] = a
    return out
