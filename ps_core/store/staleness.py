"""How stale the gradients a table applied were: a histogram and a bound.

Async workers pull rows, compute gradients, and push them while other
workers push too. A table's clock counts the pushes it applied (`clock`
starts at 1: 0 on the wire means unknown); a pull answers with it and the
push computed from that pull carries it back, so the staleness of a push is
the number of pushes the table applied in between. With one worker and
`PSClient.push_pull` it is 0.

`StalenessLog` counts pushes per staleness bucket (for `/metrics`) and, when
the model was declared with ``max_staleness``, the factor a push's gradients
are scaled by: ``(1 + max_staleness) / (1 + staleness)`` past the bound, the
staleness-dependent learning rate of Zhang et al. ("Staleness-aware
Async-SGD", 2016), so no gradient is dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BUCKETS", "StalenessLog"]

BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
"""Upper bounds (inclusive) of the histogram's buckets; one more for larger."""
_BOUNDS = np.asarray(BUCKETS, dtype=np.int64)


class StalenessLog:
    """Staleness of the pushes one table applied, and their down-weighting."""

    def __init__(self, max_staleness: int | None = None) -> None:
        self.max_staleness = max_staleness
        self.counts = np.zeros(len(BUCKETS) + 1, dtype=np.int64)
        """Pushes per bucket of `BUCKETS` (the last: above the last bound)."""
        self.total = 0
        """Sum of the staleness of every push counted."""
        self.unknown = 0
        """Pushes that carried no usable base clock (not counted)."""
        self.down_weighted = 0
        """Pushes scaled down for exceeding `max_staleness`."""

    @staticmethod
    def of(clock: int, base_clock: int) -> int | None:
        """The staleness of a push computed at `base_clock` applied at
        `clock`; None when unknown (no base clock: an older client or a geo
        push; or one from before a restore reset the table's clock)."""
        if base_clock <= 0 or base_clock > clock:
            return None
        return clock - base_clock

    def factor(self, staleness: int | None) -> float:
        """What a push of this staleness has its gradients scaled by."""
        bound = self.max_staleness
        if staleness is None or bound is None or staleness <= bound:
            return 1.0
        return (1 + bound) / (1 + staleness)

    def record(self, staleness: int | None) -> None:
        """Count an applied push of this staleness (None: unknown)."""
        if staleness is None:
            self.unknown += 1
            return
        self.counts[int(np.searchsorted(_BOUNDS, staleness))] += 1
        self.total += staleness
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.down_weighted += 1

    def stats(self) -> dict[str, Any]:
        """JSON-ready: ``buckets`` (upper bound → pushes, ``"+Inf"`` last),
        ``count``, ``sum``, ``unknown``, ``down_weighted``, ``max_staleness``."""
        labels = [str(b) for b in BUCKETS] + ["+Inf"]
        return {
            "buckets": dict(zip(labels, (int(c) for c in self.counts))),
            "count": int(self.counts.sum()),
            "sum": int(self.total),
            "unknown": self.unknown,
            "down_weighted": self.down_weighted,
            "max_staleness": self.max_staleness,
        }
