"""Mini-batches that grow with what a training has learnt (`MiniBatchRamp`).

A mini-batch's gradients are summed per key and applied in one step, at
weights that are as old as the mini-batch is long. A fresh model is where
that costs most: its bias and frequent features must move far, and with
FTRL adding the square of the summed gradient to ``n`` a 256-event
mini-batch moves them in steps one event would (on the quality stream, the
first 2,000 events' log loss is 0.397 at 256-event mini-batches against
0.308 per event). So a training starts with mini-batches of `RAMP_START`
events and lets them grow with the events it has learnt, one event per
`ratio` learnt, up to the configured size: full size after ``ratio × size``
events (16,384 at the defaults), and about 400 more pull/push steps than
fixed mini-batches in all, paid once per training's life. It starts at one
event: the first mini-batches are per-event FTRL itself, and a start of 8
events left most of what mini-batches cost on a short stream (log loss
1.0075x per-event FTRL's over 15k events, against 1.0000x from one event;
`bench/studies/linear_defaults.py --per-event`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_RAMP", "RAMP_START", "MiniBatchRamp"]

RAMP_START: Final = 1
"""Events in a ramping training's first mini-batches."""
DEFAULT_RAMP: Final = 64
"""Events learnt per event of mini-batch while ramping (``--mini-batch-ramp``;
0: fixed mini-batches from the first)."""


@dataclass(frozen=True)
class MiniBatchRamp:
    """Mini-batch sizes: ``learnt // ratio`` clipped to [`RAMP_START`, `size`]
    (`size` throughout when `ratio` is 0)."""

    size: int
    """The full mini-batch (``--mini-batch``)."""
    ratio: int = DEFAULT_RAMP

    def __post_init__(self) -> None:
        if self.size < 1 or self.ratio < 0:
            raise ValueError("a mini-batch needs size >= 1 and a ramp ratio >= 0")

    def next_size(self, learnt: int) -> int:
        """Events of the mini-batch after `learnt` events."""
        if self.ratio == 0:
            return self.size
        return min(self.size, max(RAMP_START, learnt // self.ratio))
