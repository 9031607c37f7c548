"""Keys in slots, slots on shards: the cluster's `SlotMap`.

A key belongs to slot ``mix64(key) % slots``, and a slot to the shard the
map names for it. The number of slots is fixed for a cluster's life; which
shard owns a slot may change, each change a new *epoch* of the map. So a
shard can be added, drained or relieved of a hot slot by moving slots,
without re-hashing any key.

A cluster of S shards starts with `SlotMap.even`: at least `SLOTS` slots, a
multiple of S, slot s on shard ``s % S``. Because S divides the number of
slots, ``(h % slots) % S == h % S``: the even map routes every key exactly
as ``shard_of(key, S)`` always has, so a cut written before there were
slots is the even map of its shard count, and routing by an even map costs
what ``shard_of`` costs (`owner_of` takes that path).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .hashing import mix64, shard_of

__all__ = ["SLOTS", "SlotMap", "slot_count"]

SLOTS = 4096
"""The fewest slots a cluster starts with: 2-5x more than shards is what
lets load be balanced at all; thousands let a hot slot be a small share of
a shard's load even at hundreds of shards."""

MAX_SHARDS = 1 << 15
"""Shards one map can name (owners are stored as int16)."""


def slot_count(num_shards: int, at_least: int = SLOTS) -> int:
    """The slots of a cluster started with `num_shards`: the smallest
    multiple of it that is at least `at_least` (so the even map is ``% S``)."""
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"num_shards {num_shards} not in [1, {MAX_SHARDS}]")
    return -(-max(at_least, 1) // num_shards) * num_shards


@dataclass(frozen=True)
class SlotMap:
    """Which shard owns each slot, at one epoch (see the module)."""

    epoch: int
    """The map's number: each change of an owner is a higher one."""
    num_shards: int
    """Shards of the cluster at this epoch (one may own no slot: drained)."""
    owners: tuple[int, ...] = field(repr=False)
    """Slot s's shard, for each slot."""
    _array: npt.NDArray[np.int16] = field(init=False, repr=False, compare=False)
    _owners: npt.NDArray[np.intp] = field(init=False, repr=False, compare=False)
    _even: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, slots = self.num_shards, len(self.owners)
        if not 1 <= n <= MAX_SHARDS:
            raise ValueError(f"num_shards {n} not in [1, {MAX_SHARDS}]")
        if self.epoch < 1:
            raise ValueError(f"a slot map's epoch is >= 1, not {self.epoch}")
        if slots < n:
            raise ValueError(f"{slots} slots cannot be spread over {n} shards")
        array = np.array(self.owners, dtype=np.int16)
        if array.size and (array.min() < 0 or array.max() >= n):
            raise ValueError(f"a slot's owner is not one of shards 0..{n - 1}")
        array.setflags(write=False)
        even = slots % n == 0 and bool((array == np.arange(slots) % n).all())
        object.__setattr__(self, "_array", array)
        # What `owner_of` gathers from: intp, so the gather is the answer (no conversion).
        object.__setattr__(self, "_owners", array.astype(np.intp))
        object.__setattr__(self, "_even", even)

    @classmethod
    def even(cls, num_shards: int, slots: int | None = None, epoch: int = 1) -> SlotMap:
        """`slots` (default `slot_count`) spread round-robin: slot s on shard
        ``s % num_shards``."""
        slots = slot_count(num_shards) if slots is None else slots
        return cls(epoch, num_shards, tuple(int(s) for s in np.arange(slots) % num_shards))

    @property
    def slots(self) -> int:
        return len(self.owners)

    @property
    def is_even(self) -> bool:
        """Whether it routes every key as ``shard_of(key, num_shards)``."""
        return self._even

    def slot_of(self, keys: npt.ArrayLike) -> npt.NDArray[np.intp]:
        """Each key's slot, ``mix64(key) % slots``."""
        h = mix64(keys)  # a fresh array: reduced in place
        slots = self.slots
        if slots & (slots - 1) == 0:
            h &= np.uint64(slots - 1)  # the same as %, without a division (4,096 slots: 1-8 shards)
        else:
            h %= np.uint64(slots)
        return h.view(np.intp) if h.dtype.itemsize == np.dtype(np.intp).itemsize else h.astype(np.intp)

    def owner_of(self, keys: npt.ArrayLike) -> npt.NDArray[np.intp]:
        """Each key's shard: one vectorised pass, the even map's as ``shard_of``."""
        if self._even:
            return shard_of(keys, self.num_shards)
        out: npt.NDArray[np.intp] = self._owners.take(self.slot_of(keys))
        return out

    def slots_of(self, shard: int) -> npt.NDArray[np.intp]:
        """The slots `shard` owns, ascending."""
        return np.flatnonzero(self._array == shard)

    def load(self) -> npt.NDArray[np.int64]:
        """Slots owned by each shard, (num_shards,)."""
        return np.bincount(self._array, minlength=self.num_shards).astype(np.int64)

    def moved(self, moves: Mapping[int, int] | Iterable[tuple[int, int]], num_shards: int | None = None) -> SlotMap:
        """The next epoch's map: slot → new owner for each of `moves`, and
        `num_shards` if the cluster grows or shrinks."""
        owners = np.array(self.owners, dtype=np.int64)
        for slot, shard in dict(moves).items():
            if not 0 <= slot < self.slots:
                raise ValueError(f"no slot {slot}: the map has {self.slots}")
            owners[slot] = shard
        n = self.num_shards if num_shards is None else num_shards
        return SlotMap(self.epoch + 1, n, tuple(int(o) for o in owners))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: epoch, shards, slots, and the owners as runs
        ``[first_slot, end, shard]`` of consecutive slots (one run per
        slot for the even map of more than one shard: it says ``even``)."""
        out: dict[str, Any] = {"epoch": self.epoch, "num_shards": self.num_shards, "slots": self.slots}
        if self._even:
            out["even"] = True
            return out
        a = self._array
        starts = np.flatnonzero(np.r_[True, a[1:] != a[:-1]])
        ends = np.r_[starts[1:], a.size]
        out["runs"] = [[int(s), int(e), int(a[s])] for s, e in zip(starts, ends)]
        return out

    @classmethod
    def from_dict(cls, raw: object) -> SlotMap:
        """Parse `to_dict`'s form; `ValueError` naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("a slot map is a JSON object")
        epoch, n, slots = (_integer(raw, k) for k in ("epoch", "num_shards", "slots"))
        if raw.get("even"):
            if slots < n or slots % n:
                raise ValueError(f"an even map of {n} shards has a multiple of {n} slots, not {slots}")
            return cls.even(n, slots, epoch)
        runs = raw.get("runs")
        if not isinstance(runs, list):
            raise ValueError("a slot map that is not even lists its runs")
        owners = np.full(slots, -1, dtype=np.int64)
        end = 0
        for run in runs:
            if not (isinstance(run, list) and len(run) == 3 and all(isinstance(v, int) for v in run)):
                raise ValueError(f"a run is [first_slot, end, shard], not {run!r}")
            first, stop, shard = run
            if first != end or stop <= first or stop > slots:
                raise ValueError(f"runs must cover slots 0..{slots - 1} in order; got [{first}, {stop})")
            owners[first:stop] = shard
            end = stop
        if end != slots:
            raise ValueError(f"runs cover slots up to {end}, the map has {slots}")
        return cls(epoch, n, tuple(int(o) for o in owners))


def _integer(raw: Mapping[str, object], name: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"a slot map's {name} is an integer, not {value!r}")
    return value
