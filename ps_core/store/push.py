"""What a push goes through before the optimizer steps its rows.

`checked_push` turns a push's arguments into arrays or refuses it whole;
`admitted` drops the keys without a row that the lifecycle does not admit
(`ps_core.store.lifecycle.Admission`, then the lazy-embedding gate);
`sum_duplicates` sums the gradients and counts of keys that repeat. All are
vectorised: no loop over keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypedDict

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError
from ..hashing import U64
from .lifecycle import Admission
from .pull_cache import PulledRows
from .storage import F32, RowStorage

__all__ = ["PushExtras", "CheckedPush", "checked_push", "admitted", "sum_duplicates"]


class PushExtras(TypedDict, total=False):
    """What a push (`SparseTable.push`, `hold`) may carry beside its keys and gradients."""

    counts: npt.ArrayLike | None
    """(n, 2) shows and clicks to add to the rows (None: none)."""
    event_time: float | None
    """Seconds since the epoch, the rows' ``last_seen`` (None: now)."""


class CheckedPush(NamedTuple):
    """A push's arguments as arrays (`checked_push`)."""

    keys: U64
    grads: F32
    """(n, dim) float32."""
    counts: F32 | None
    """(n, 2) whole shows and clicks, or None."""
    event_time: float


def checked_push(table: str, dim: int, keys: npt.ArrayLike, grads: npt.ArrayLike, extras: PushExtras) -> CheckedPush:
    """A push's keys, gradients (n, dim), counts (n, 2) or None, and event
    time, as arrays; raises `InvalidValuesError` for any bad one."""
    k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
    g = np.asarray(grads, dtype=np.float32)
    if g.ndim == 1 and dim == 1:
        g = g.reshape(-1, 1)
    if g.shape != (k.size, dim):
        raise InvalidValuesError(f"table {table}: gradients of shape {g.shape} for {k.size} keys of dim {dim}")
    # One pass: a float64 sum of float32 values cannot overflow (below
    # 10**269 of them), so it is finite exactly when they all are.
    if not math.isfinite(g.sum(dtype=np.float64)):
        raise InvalidValuesError(f"table {table}: gradients hold NaN or inf")
    c = None
    counts, event_time = extras.get("counts"), extras.get("event_time")
    if counts is not None:
        c = np.asarray(counts, dtype=np.float32).reshape(-1, 2) if k.size else None
        # min and max propagate NaN, so the comparisons reject NaN and
        # +-inf too; then whole numbers (np.floor is far cheaper than
        # np.modf).
        if c is not None and (
            c.shape[0] != k.size or not c.min() >= 0 or not c.max() < np.inf or not (np.floor(c) == c).all()
        ):
            raise InvalidValuesError(f"table {table}: counts must be (n, 2), finite, whole and >= 0")
    seen = time.time() if event_time is None else event_time
    if not (math.isfinite(seen) and 0 <= seen < 2**32):
        raise InvalidValuesError(f"table {table}: event time {seen!r} is not seconds in [0, 2**32)")
    return CheckedPush(k, g, c, seen)


def _looked_up(storage: RowStorage, k: U64, pulled: PulledRows | None) -> PulledRows:
    """What the lookup of `k` finds: the pull's (its absent keys looked up
    again if keys were inserted since), or a probe's."""
    if pulled is None:
        rows, free = storage.index.probe(k)
        missing = np.flatnonzero(rows < 0)
        return PulledRows(
            k, rows, missing, free.take(missing), None, storage.index.mutations, storage.pull_cache.writes
        )
    if pulled.missing.size and pulled.free is None:
        # Inserts since the pull: some keys absent then may have rows now.
        again = storage.index.lookup(k.take(pulled.missing))
        pulled.rows[pulled.missing] = again
        pulled = pulled._replace(missing=pulled.missing[again < 0])
    return pulled


def admitted(
    storage: RowStorage,
    push: CheckedPush,
    pulled: PulledRows | None,
    admission: Admission | None,
    gate: Callable[[U64], npt.NDArray[np.bool_]] | None,
) -> tuple[CheckedPush, PulledRows, int]:
    """The push without the keys that have no row and are not admitted
    (`Admission.decide`, then the lazy-embedding `gate`), what the lookup
    found for the rest (the pull's, or a probe's, reused by
    `RowStorage.rows_for_push`), and how many key updates the gate dropped."""
    k, c = push.keys, push.counts
    pulled = _looked_up(storage, k, pulled)
    missing = pulled.missing
    if not missing.size:
        return push, pulled, 0
    absent = k.take(missing)
    ok = np.ones(missing.size, dtype=bool)
    if admission is not None:
        ok = admission.decide(absent, None if c is None else c[missing])
    gated = 0
    if gate is not None:
        passed = gate(absent)
        gated = int(np.count_nonzero(ok & ~passed))
        ok &= passed
    if ok.all():
        return push, pulled, gated
    keep = np.ones(k.size, dtype=bool)
    keep[missing[~ok]] = False
    position = np.cumsum(keep) - 1  # of each kept key in the kept push
    gathered = pulled.gathered
    pulled = PulledRows(
        k[keep],
        pulled.rows[keep],
        position[missing[ok]],
        None if pulled.free is None else pulled.free[ok],
        None if gathered is None else (gathered[0][keep], gathered[1][keep], gathered[2][keep]),
        pulled.mutations,
        pulled.writes,
    )
    kept = push._replace(keys=k[keep], grads=push.grads[keep], counts=None if c is None else c[keep])
    return kept, pulled, gated


def sum_duplicates(
    rows: npt.NDArray[np.int64], g: F32, c: F32 | None
) -> tuple[npt.NDArray[np.int64], F32, npt.NDArray[Any] | None]:
    """The distinct rows, and the gradients and counts of each summed."""
    uniq, inverse = np.unique(rows, return_inverse=True)
    inverse = inverse.reshape(-1)
    m = uniq.size
    dim = g.shape[1]
    # Reusing the inverse with bincount beats np.add.at by a wide margin.
    summed = np.empty((m, dim), dtype=np.float32)
    for j in range(dim):
        summed[:, j] = np.bincount(inverse, weights=g[:, j], minlength=m)
    row_counts = None
    if c is not None:
        row_counts = np.stack([np.bincount(inverse, c[:, 0], m), np.bincount(inverse, c[:, 1], m)], axis=1)
    return uniq, summed, row_counts
