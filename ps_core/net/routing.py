"""Routing a batch of keys to shards: which run of a grouped order each shard owns."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..hashing import U64
from ..slots import SlotMap

__all__ = ["split_by_shard"]

I64 = npt.NDArray[np.int64]


def split_by_shard(keys: U64, slot_map: SlotMap) -> tuple[npt.NDArray[np.intp] | None, I64]:
    """The permutation grouping `keys` by the shard `slot_map` gives them
    (None when one shard owns every key) and the (num_shards + 1,) bounds of
    each shard's run in the grouped order."""
    num_shards = slot_map.num_shards
    if num_shards == 1:
        return None, np.array([0, keys.size], dtype=np.int64)
    sid = slot_map.owner_of(keys)
    # A stable sort of 16-bit values is a radix sort: ~3x faster than of intp.
    order = np.argsort(sid.astype(np.uint16) if num_shards <= 1 << 16 else sid, kind="stable")
    bounds = np.zeros(num_shards + 1, dtype=np.int64)
    np.cumsum(np.bincount(sid, minlength=num_shards), out=bounds[1:])
    return order, bounds
