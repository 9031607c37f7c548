"""Growing an array in place, so that a table holds little more than its rows.

`grow` resizes an array that owns its memory with ``realloc``
(`numpy.ndarray.resize`). A large block is a mapping of its own, which the
allocator grows by remapping its pages rather than copying them: arrays can
then grow by small steps (`next_capacity`: a 32nd at a time), keeping the
slack under 3 % instead of up to a third with 1.5x copies, and a growth
costs no copy of the table. Views of the array are invalid afterwards: the
owner makes them again at once.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

__all__ = ["grow", "next_capacity", "STEP"]

STEP = 32
"""Arrays grow by 1/STEP of their size (at least `MIN_GROWTH` entries)."""
MIN_GROWTH = 1024


def next_capacity(capacity: int, needed: int) -> int:
    """The capacity to grow to from `capacity` to hold `needed` entries."""
    return max(needed, capacity + max(capacity // STEP, MIN_GROWTH))


def grow(a: npt.NDArray[Any], shape: tuple[int, ...]) -> None:
    """Resize `a` (which owns its memory, C-contiguous) to `shape` in place:
    leading rows keep their contents, new ones are zero. Views of `a` made
    before are invalid after."""
    a.resize(shape, refcheck=False)
