"""The shard's side of a live slot move (`SlotMoves`).

A move gives slots of shard A to shard B at the slot map's next epoch
(`ps_core.checkpoint.moves` runs it):

- A's `hand_off(slots, new_map)`, in one step (nothing else runs meanwhile),
  copies every table's rows of those slots (weights, optimizer state, event
  time, counts), removes them (its next delta lists them as deleted) and
  takes the new map: from then on it refuses their keys as `moved`. The
  copies stay `held` until `release`, so a move whose destination failed
  can still deliver or give them back.
- B's `take_over(snapshots, new_map)`, in one step, upserts the rows as they
  were, flagged changed so that its next delta carries them, and takes the
  new map.

Pushes of those keys between the two steps are refused by both shards (A's
map is newer than the client's, B's older); clients wait for the maps to
agree and send them again (`ps_core.net.client`). A sync table holding an
open step's pushes is not handed off (`MoveRefusedError`): they would be
applied on A after the move.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import MoveRefusedError, TableConflictError
from ..slots import SlotMap
from ..store.snapshot import TableSnapshot
from .spec import ShardSpec
from .tables import ShardTables

__all__ = ["SlotMoves"]


class SlotMoves:
    """Slots handed off and taken over by the shard of `tables`."""

    def __init__(self, spec: ShardSpec, tables: ShardTables) -> None:
        self.spec = spec
        self._tables = tables
        self.held: dict[int, list[TableSnapshot]] = {}
        """The rows handed off, by the epoch of the map that moved them, until `release`."""
        self.rows_out = 0
        """Rows handed off since start."""
        self.rows_in = 0
        """Rows taken over since start."""

    def _check_next(self, new_map: SlotMap) -> SlotMap:
        old = self._tables.slot_map
        if new_map.num_shards != self.spec.num_shards or new_map.slots != old.slots:
            raise MoveRefusedError(
                f"a map of {new_map.num_shards} shards and {new_map.slots} slots for shard {self.spec.shard_id} "
                f"of {self.spec.num_shards} with {old.slots} slots"
            )
        if new_map.epoch <= old.epoch:
            raise MoveRefusedError(
                f"slot map epoch {new_map.epoch} is not newer than shard {self.spec.shard_id}'s {old.epoch}"
            )
        return old

    def hand_off(self, slots: Sequence[int], new_map: SlotMap) -> list[TableSnapshot]:
        """Copy and remove the rows of `slots` (this shard's, another's in
        `new_map`) from every table, take `new_map`; the copies."""
        old = self._check_next(new_map)
        moving = _slot_mask(old.slots, slots)
        me = self.spec.shard_id
        owners_before, owners_after = np.array(old.owners), np.array(new_map.owners)
        if (owners_before[moving] != me).any() or (owners_after[moving] == me).any():
            raise MoveRefusedError(f"shard {me} hands off only slots it owns, to another shard")
        if ((~moving) & ((owners_before == me) != (owners_after == me))).any():
            raise MoveRefusedError(f"the map of epoch {new_map.epoch} changes slots of shard {me} not handed off")
        open_steps = [t.config.name for t in self._tables.by_name.values() if t.held_keys]
        if open_steps:
            raise MoveRefusedError(f"tables {open_steps} hold an open sync step's pushes: move after it closes")

        def select(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            out: npt.NDArray[np.bool_] = moving[old.slot_of(keys)]
            return out

        copies = [t.rows_where(select) for t in self._tables.by_name.values()]
        for table, snap in zip(self._tables.by_name.values(), copies):
            table.delete(snap.keys, distinct=True)
        self._tables.slot_map = new_map
        self.held[new_map.epoch] = copies
        self.rows_out += sum(s.rows for s in copies)
        return copies

    def take_over(self, snapshots: Sequence[TableSnapshot], new_map: SlotMap) -> int:
        """Upsert the rows another shard handed off (changed: the next delta
        carries them), take `new_map`; the rows taken. Every key must be in a
        slot `new_map` gives this shard."""
        self._check_next(new_map)
        me = self.spec.shard_id
        for snap in snapshots:
            if snap.rows and (new_map.owner_of(snap.keys) != me).any():
                raise MoveRefusedError(f"rows of table {snap.table} in slots not shard {me}'s at epoch {new_map.epoch}")
            held = self._tables.by_name.get(snap.table)
            if held is not None and not held.config.accepts(snap.config):
                raise TableConflictError(
                    f"table {snap.table} moved in as {snap.config.to_dict()}, held as {held.config.to_dict()}"
                )
        taken = 0
        for snap in snapshots:
            self._tables.declare(snap.config)  # held already: accepted as it is
            table = self._tables.by_name[snap.table]
            # Counts are stored relative to a table's own scale: the source's rescaled to ours.
            scale = np.float32(float(snap.count_scale[0]) / table.count_scale)
            table.load_rows(
                snap.keys,
                snap.data,
                snap.updated_at,
                snap.last_seen,
                snap.shows * scale,
                snap.clicks * scale,
                changed=True,
            )
            taken += snap.rows
        self._tables.slot_map = new_map
        self.rows_in += taken
        return taken

    def adopt(self, new_map: SlotMap) -> bool:
        """Take `new_map` if it is newer and leaves this shard's slots as they
        are (a move between other shards); False for one not newer.
        `MoveRefusedError` for one that gives or takes this shard's slots:
        only a hand-off or a take-over does, with the rows."""
        if new_map.epoch <= self._tables.slot_map.epoch:
            return False
        old = self._check_next(new_map)
        me = self.spec.shard_id
        if ((np.array(old.owners) == me) != (np.array(new_map.owners) == me)).any():
            raise MoveRefusedError(
                f"slot map epoch {new_map.epoch} gives or takes slots of shard {me}: only a hand-off or a take-over does"
            )
        self._tables.slot_map = new_map
        return True

    def stats(self) -> dict[str, int]:
        """The shard's slots and the rows moves carried (``slots`` of its stats)."""
        m = self._tables.slot_map
        return {
            "epoch": m.epoch,
            "owned": int(m.slots_of(self.spec.shard_id).size),
            "slots": m.slots,
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "held": sum(s.rows for copies in self.held.values() for s in copies),
        }

    def release(self, epoch: int) -> int:
        """Drop the copies handed off at `epoch` (the move is done); the rows dropped."""
        return sum(s.rows for s in self.held.pop(epoch, []))


def _slot_mask(slots: int, chosen: Sequence[int]) -> npt.NDArray[np.bool_]:
    """(slots,) True at each of `chosen`; `MoveRefusedError` for none or one out of range."""
    at = np.asarray(chosen, dtype=np.int64)
    if at.size == 0 or at.min() < 0 or at.max() >= slots:
        raise MoveRefusedError(f"slots to move must be in [0, {slots}), at least one")
    mask = np.zeros(slots, dtype=bool)
    mask[at] = True
    return mask
