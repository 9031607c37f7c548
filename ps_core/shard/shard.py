"""One shard of the parameter server, as pure handlers (no sockets): `Shard`.

A `Shard` owns the keys of the slots its slot map gives it (`ps_core.slots`) in every
table. It composes its tables (`tables`), its admission to the cluster
(`join_state`), its data handlers (`handlers`), the export cuts it takes
part in (`cuts`), the key sets its pulls keep (`key_sets`) and the status
board (`status_board`). The HTTP server, the RPC (through
`ps_core.net.frame_handler`) and the in-process transport all call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..slots import SlotMap
from ..store.change_log import DEFAULT_LOG_KEYS
from ..store.lifecycle import Lifecycle
from ..store.table import SparseTable
from ..store.table_config import TableConfig
from .cuts import HeldCuts
from .handlers import DataHandlers
from .join_state import JoinState, RestoreAt
from .key_sets import KeySets
from .slot_moves import SlotMoves
from .spec import ShardSpec
from .status_board import StatusBoard
from .tables import ShardTables

__all__ = ["Shard"]


class Shard:
    """The tables of one shard and the handlers that read and update them."""

    def __init__(
        self,
        spec: ShardSpec = ShardSpec(0, 1),
        tables: Iterable[TableConfig] = (),
        *,
        dedup_window: int = 4096,
        max_sources: int = 256,
        lifecycle: Lifecycle | None = None,
        change_log_keys: int = DEFAULT_LOG_KEYS,
        restore_dir: RestoreAt = None,
        restores_at_start: bool = False,
    ) -> None:
        """`dedup_window` push ids are remembered for retry dedup; the status
        board keeps the latest status of the `max_sources` most recent
        sources; `lifecycle` is that of tables declared without one;
        `change_log_keys`, what each geo table's change log holds at most
        (`ps_core.store.change_log`); `restore_dir`, the model's exports
        directory the coordinator may have it load a version from;
        `restores_at_start`, whether it was started to restore the newest
        export (holding nothing then means nothing loaded)."""
        self.spec = spec
        self._tables = ShardTables(spec, tables, lifecycle=lifecycle, change_log_keys=change_log_keys)
        self.join_state = JoinState(
            spec, self._tables.pushes, restore_dir=restore_dir, restores_at_start=restores_at_start
        )
        """Whether the coordinator admitted this shard, and at which state."""
        self.handlers = DataHandlers(self._tables, self.join_state, dedup_window=dedup_window)
        self.cuts = HeldCuts(self._tables, self.join_state)
        self.board = StatusBoard(max_sources)
        self.key_sets = KeySets()
        """Pulled key sets kept for the pushes that name them (`ps_core.shard.key_sets`)."""
        self._reply_values_clipped = 0
        self._extra_stats: dict[str, Callable[[], dict[str, Any]]] = {}
        # The handlers, bound once: the hot path calls them without a hop.
        self.handle_pull = self.handlers.handle_pull
        self.handle_push = self.handlers.handle_push
        self.handle_push_pull = self.handlers.handle_push_pull
        self.handle_changes = self.handlers.handle_changes
        self.contains = self.handlers.contains
        self.apply_step = self.handlers.apply_step
        self.evict = self.handlers.evict
        self.declare = self._tables.declare
        self.configure = self._tables.configure
        self.table = self._tables.table
        self.report_status = self.board.report
        self.statuses = self.board.entries
        self.slot_moves = SlotMoves(spec, self._tables)
        """Slots handed off to and taken over from other shards (`ps_core.shard.slot_moves`)."""
        self.take_snapshot = self.cuts.take
        self.drop_snapshot = self.cuts.drop
        self.pop_snapshot = self.cuts.pop
        self.membership = self.join_state.report
        self.admit = self.join_state.admit
        self.leave = self.join_state.leave
        self.mark_state = self.join_state.mark_state

    # -- what is read of its parts -------------------------------------------------
    @property
    def tables(self) -> dict[str, SparseTable]:
        """The tables held, by name."""
        return self._tables.by_name

    @property
    def joined(self) -> bool:
        """Whether the coordinator admitted this shard into the cluster."""
        return self.join_state.joined

    @property
    def joined_epoch(self) -> str:
        """The epoch of the coordinator that admitted it ("" from the start)."""
        return self.join_state.epoch

    @property
    def last_contact(self) -> float:
        """Monotonic time the coordinator last asked this shard's membership."""
        return self.join_state.last_contact

    @property
    def state_version(self) -> int:
        """The export version of the state at the last restore or cut (0: none)."""
        return self.join_state.state_version

    @property
    def restore_dir(self) -> RestoreAt:
        """The model's exports directory, where a restore loads from (None: none)."""
        return self.join_state.restore_dir

    @property
    def configured_tables(self) -> tuple[TableConfig, ...]:
        """The tables this shard was configured with (declared again after a restore)."""
        return self._tables.configured

    @property
    def default_lifecycle(self) -> Lifecycle | None:
        """The lifecycle of tables declared without one (None: `NO_LIFECYCLE`)."""
        return self._tables.default_lifecycle

    @property
    def duplicate_pushes(self) -> int:
        """Retried pushes recognised by request id and not applied again."""
        return self.handlers.duplicate_pushes

    @property
    def sync_steps(self) -> dict[str, int]:
        """The last sync step applied, per table."""
        return self.handlers.sync_steps

    @property
    def pending_snapshots(self) -> list[int]:
        """Versions of the cut copies held, not yet fetched, oldest first."""
        return self.cuts.pending

    # -- what others configure ------------------------------------------------------
    def reconfigure(self, tables: Sequence[TableConfig], lifecycle: Lifecycle | None) -> None:
        """The operator's configuration over restored tables (`ShardTables.reconfigure`)."""
        self._tables.reconfigure(tables, lifecycle)

    def restored(self, version: int, restore_dir: RestoreAt) -> None:
        """Record that this shard was started from export `version`, restored
        from `restore_dir`: its state is exactly that version."""
        self.join_state.mark_state(version)
        self.join_state.restores_at_start = True
        self.join_state.restore_dir = restore_dir

    @property
    def slot_map(self) -> SlotMap:
        """The slots this shard owns, at the map's epoch (`ps_core.slots`)."""
        return self._tables.slot_map

    def adopt_slot_map(self, slot_map: SlotMap) -> bool:
        """Own the slots `slot_map` gives this shard, if it is newer than the
        map held (a higher epoch); True when taken. A map of another shard
        count than this shard was started in is `ValueError`."""
        if slot_map.num_shards != self.spec.num_shards:
            raise ValueError(
                f"a slot map of {slot_map.num_shards} shards for shard {self.spec.shard_id} of {self.spec.num_shards}"
            )
        if slot_map.epoch <= self._tables.slot_map.epoch:
            return False
        self._tables.slot_map = slot_map
        return True

    def replace_state(self, other: Shard, version: int) -> None:
        """Take `other`'s tables (a restore of `version`, built aside) in one
        step; the copies held and the push ids remembered belong to the old
        state and are dropped. The same object keeps serving, so servers and
        transports holding it see the new state at once."""
        if other.spec != self.spec:
            raise ValueError(f"a restore of {other.spec} into shard {self.spec}")
        self._tables.adopt(other._tables)
        # The restored rows sit where the cut's map put them: its map comes
        # with them, older than the one held if slots moved after the cut.
        self._tables.slot_map = other.slot_map
        self.cuts.clear()
        self.handlers.forget_pushes()
        self.join_state.mark_state(version)

    def drop(self, name: str) -> bool:
        """Remove table `name` and its rows (`ShardTables.drop`)."""
        return self._tables.drop(name)

    def add_stats(self, name: str, section: Callable[[], dict[str, Any]]) -> None:
        """Add section `name` to `stats`: what this shard's process hosts (shard
        0: ``exports``, the exporter's counters; ``cluster``, the
        coordinator's view of the shards), so metrics reach it through the
        shard's stats like every other figure."""
        self._extra_stats[name] = section

    def count_clipped(self, values: int) -> None:
        """Count weights clipped to float16's range in a reply asked in float16."""
        self._reply_values_clipped += values

    def stats(self) -> dict[str, Any]:
        """Features, bytes and call counts per table (JSON-ready)."""
        return {
            "shard_id": self.spec.shard_id,
            "num_shards": self.spec.num_shards,
            "duplicate_pushes": self.handlers.duplicate_pushes,
            "wire": {"key_sets": self.key_sets.stats(), "reply_values_clipped": self._reply_values_clipped},
            "slots": self.slot_moves.stats(),
            "tables": {
                name: {
                    "features": len(t),
                    "bytes": t.memory_bytes(),
                    "pushes": t.pushes,
                    "pulls": t.pulls,
                    "version": t.version,
                    "config": t.config.to_dict(),
                    "lifecycle": t.lifecycle_stats(),
                    "staleness": t.staleness.stats(),
                    **({} if t.changes is None else {"change_log": t.changes.stats()}),
                }
                for name, t in self.tables.items()
            },
            **{name: section() for name, section in self._extra_stats.items()},
        }
