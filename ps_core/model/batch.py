"""The batch of hashed events: feature ids in CSR form, with their values,
labels, weights and event times (`EventBatch`).

`FeatureHasher.featurize` makes one; models read it; the worker slices and
joins them. Everything here is numpy over whole arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..hashing import U64

__all__ = ["F32", "F64", "I64", "EventBatch"]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class EventBatch:
    """Hashed events in CSR form: event i has ``keys[offsets[i]:offsets[i+1]]``."""

    keys: U64
    """Feature ids of all events, concatenated (the bias id first in each event)."""
    values: F32
    """The value of each feature occurrence (1 for categorical)."""
    offsets: I64
    """(n + 1,) start of each event's features in `keys`."""
    labels: F32
    """(n,) 0/1 labels (NaN where absent, e.g. predict requests)."""
    weights: F32
    """(n,) sample weights (1 by default)."""
    ts: F64
    """(n,) event times in seconds (NaN where absent)."""
    index: I64
    """(n,) position of each event in the `featurize` input (rejected ones skipped)."""

    @property
    def size(self) -> int:
        """Number of events."""
        return int(self.labels.size)

    def event_of_feature(self) -> I64:
        """(nnz,) the event each feature occurrence belongs to."""
        return np.repeat(np.arange(self.size, dtype=np.int64), np.diff(self.offsets))

    @staticmethod
    def concat(batches: Sequence[EventBatch], index_shifts: Sequence[int]) -> EventBatch:
        """Batches one after the other; `index_shifts[i]` is added to batch i's `index`."""
        if len(batches) == 1 and index_shifts[0] == 0:
            return batches[0]
        sizes = np.array([b.keys.size for b in batches], dtype=np.int64)
        key_shift = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        offsets = np.concatenate(
            [b.offsets[:-1] + key_shift[i] for i, b in enumerate(batches)] + [np.array([sizes.sum()])]
        ).astype(np.int64)
        return EventBatch(
            keys=np.concatenate([b.keys for b in batches]),
            values=np.concatenate([b.values for b in batches]),
            offsets=offsets,
            labels=np.concatenate([b.labels for b in batches]),
            weights=np.concatenate([b.weights for b in batches]),
            ts=np.concatenate([b.ts for b in batches]),
            index=np.concatenate([b.index + shift for b, shift in zip(batches, index_shifts)]),
        )

    def slice(self, start: int, stop: int) -> EventBatch:
        """Events ``start:stop`` as views of this batch (no copy)."""
        o0, o1 = int(self.offsets[start]), int(self.offsets[stop])
        return EventBatch(
            keys=self.keys[o0:o1],
            values=self.values[o0:o1],
            offsets=self.offsets[start : stop + 1] - o0,
            labels=self.labels[start:stop],
            weights=self.weights[start:stop],
            ts=self.ts[start:stop],
            index=self.index[start:stop],
        )

    def select(self, events: I64) -> EventBatch:
        """A batch of the given events (sorted positions in this batch)."""
        lens = np.diff(self.offsets)[events]
        starts = self.offsets[:-1][events]
        take = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(
            int(lens.sum()), dtype=np.int64
        )
        return EventBatch(
            keys=self.keys[take],
            values=self.values[take],
            offsets=np.concatenate(([0], np.cumsum(lens))).astype(np.int64),
            labels=self.labels[events],
            weights=self.weights[events],
            ts=self.ts[events],
            index=self.index[events],
        )
