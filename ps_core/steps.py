"""Training steps planned ahead: the part of a mini-batch that does not depend
on the weights.

A worker trains a window in mini-batches: pull the distinct ids, predict,
compute gradients, push. Before any weight is read, each mini-batch already
fixes its distinct ids and where each occurrence points (`distinct`, the
costliest step), how those ids split over the shards, and the shows and
clicks each id gets. `plan_steps` computes all of it for a decoded batch, so
the worker's decode processes can do it beside the decoding and the event
loop that pulls and pushes does none of it.

A `TrainStep` is data only (numpy arrays and numbers): it pickles cheaply
from a decode process, and `shifted` re-bases it when decoded chunks are
concatenated into a window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from .features import EventBatch
from .hashing import U64, distinct, shard_of

__all__ = ["TrainStep", "plan_steps", "split_by_shard"]

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


def split_by_shard(keys: U64, num_shards: int) -> tuple[npt.NDArray[np.intp] | None, I64]:
    """The permutation grouping `keys` by shard (None with one shard) and the
    (num_shards + 1,) bounds of each shard's run in the grouped order."""
    if num_shards == 1:
        return None, np.array([0, keys.size], dtype=np.int64)
    sid = shard_of(keys, num_shards)
    # A stable sort of 16-bit values is a radix sort: ~3x faster than of intp.
    order = np.argsort(sid.astype(np.uint16) if num_shards <= 1 << 16 else sid, kind="stable")
    bounds = np.zeros(num_shards + 1, dtype=np.int64)
    np.cumsum(np.bincount(sid, minlength=num_shards), out=bounds[1:])
    return order, bounds


@dataclass(frozen=True)
class TrainStep:
    """One mini-batch of a batch, planned: events ``start:stop``."""

    start: int
    """First event of the mini-batch in its batch."""
    stop: int
    """One past its last event."""
    keys: U64
    """(u,) distinct feature ids of the mini-batch, sorted (what to pull and push)."""
    inverse: I32
    """(nnz,) index into `keys` of each feature occurrence of the mini-batch."""
    order: npt.NDArray[np.intp] | None
    """Permutation of `keys` grouping them by shard (None with one shard)."""
    bounds: I64
    """(num_shards + 1,) each shard's run in the grouped order."""
    counts: F32
    """(u, 2) shows and clicks of each distinct id in the mini-batch."""
    event_time: float
    """Latest event time (seconds) of the mini-batch; NaN when none has one."""

    def shifted(self, events: int) -> TrainStep:
        """The same step in a batch where this one's events start `events` later."""
        return replace(self, start=self.start + events, stop=self.stop + events)


def plan_steps(batch: EventBatch, mini_batch: int, num_shards: int) -> list[TrainStep]:
    """Consecutive steps of at most `mini_batch` events covering `batch`."""
    if mini_batch < 1 or num_shards < 1:
        raise ValueError("mini_batch and num_shards must be positive")
    steps = []
    for start in range(0, batch.size, mini_batch):  # per mini-batch, not per event
        stop = min(start + mini_batch, batch.size)
        sub = batch.slice(start, stop)
        keys, inverse = distinct(sub.keys)
        inv = inverse.astype(np.int32)
        u = keys.size
        counts = np.empty((u, 2), dtype=np.float32)
        counts[:, 0] = np.bincount(inv, minlength=u)
        clicks = np.repeat(sub.labels.astype(np.float64), np.diff(sub.offsets))
        counts[:, 1] = np.bincount(inv, clicks, u)
        ts = sub.ts[np.isfinite(sub.ts)]
        order, bounds = split_by_shard(keys, num_shards)
        steps.append(
            TrainStep(start, stop, keys, inv, order, bounds, counts, float(ts.max()) if ts.size else float("nan"))
        )
    return steps
