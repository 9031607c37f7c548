"""A shard's tables and their declarations (`ShardTables`).

Declares tables (an identical re-declaration is accepted, a different one
refused), applies the shard's default lifecycle to tables declared without
one, wires lazy embeddings to their gating table, and checks that keys are
this shard's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from ..errors import ModeConflictError, MovedError, TableConflictError, UnknownTableError
from ..slots import SlotMap
from ..store.change_log import DEFAULT_LOG_KEYS
from ..store.lifecycle import Lifecycle
from ..store.table import SparseTable
from ..store.table_config import TableConfig
from .spec import ShardSpec

__all__ = ["ShardTables", "mode_of"]


def mode_of(config: TableConfig) -> str:
    """A table's mode as a worker's flags say it (``async, max_staleness 8``)."""
    return config.mode if config.max_staleness is None else f"{config.mode}, max_staleness {config.max_staleness}"


class ShardTables:
    """The tables of shard `spec`, by name, and the configuration they were declared with."""

    def __init__(
        self,
        spec: ShardSpec,
        tables: Iterable[TableConfig] = (),
        *,
        lifecycle: Lifecycle | None = None,
        change_log_keys: int = DEFAULT_LOG_KEYS,
    ) -> None:
        """`lifecycle` is that of tables declared without one; `change_log_keys`,
        what each geo table's change log holds at most (`ps_core.store.change_log`)."""
        self.spec = spec
        self.slot_map = SlotMap.even(spec.num_shards)
        """The slots this shard owns, at the map's epoch (`ps_core.slots`):
        the even map of its shard count until the coordinator gives another."""
        self.change_log_keys = change_log_keys
        self.default_lifecycle = lifecycle
        """The lifecycle of tables declared without one (None: `NO_LIFECYCLE`)."""
        self.by_name: dict[str, SparseTable] = {}
        """The tables held; replaced whole by a restore (`adopt`)."""
        configs = tuple(tables)
        self.configured: tuple[TableConfig, ...] = configs
        """The tables this shard was started with (declared again after a restore)."""
        for config in configs:
            self.declare(config)

    def pushes(self) -> int:
        """Pushes applied to every table held."""
        return sum(t.pushes for t in self.by_name.values())

    def adopt(self, other: ShardTables) -> None:
        """Take `other`'s tables in one step (a restore built aside)."""
        self.by_name = other.by_name

    def reconfigure(self, tables: Iterable[TableConfig], lifecycle: Lifecycle | None) -> None:
        """Apply the operator's configuration over restored tables: `lifecycle`
        for tables declared without one, each of `tables` configured (`configure`),
        and `tables` what a later restore declares again."""
        self.default_lifecycle = lifecycle
        configs = tuple(tables)
        for config in configs:
            self.configure(config)
        self.configured = configs

    def declare(self, config: TableConfig) -> bool:
        """Create a table, or accept an identical re-declaration.

        Returns True when the table was created. A declaration that differs
        from the existing table's is a `TableConflictError`, never an overwrite.
        """
        existing = self.by_name.get(config.name)
        if existing is not None:
            had, asked = existing.config, config
            if (had.mode, had.max_staleness) != (asked.mode, asked.max_staleness):
                raise ModeConflictError(
                    f"table {config.name} is updated in mode {mode_of(had)}; a worker declared it with mode "
                    f"{mode_of(asked)}: every worker of a model must run the same --mode (and --max-staleness)"
                )
            if not existing.config.accepts(config):
                raise TableConflictError(
                    f"table {config.name} exists with {existing.config.to_dict()}, "
                    f"declared again with {config.to_dict()}"
                )
            return False
        if config.lifecycle is None and self.default_lifecycle is not None:
            config = replace(config, lifecycle=self._default_for(config))
        table = self.by_name[config.name] = SparseTable(config, change_log_keys=self.change_log_keys)
        self._gate(table)
        return True

    def _default_for(self, config: TableConfig) -> Lifecycle | None:
        """The shard's default lifecycle as it applies to `config` (lazy
        embeddings only for embedding tables, `TableConfig.embeddings`)."""
        lc = self.default_lifecycle
        if lc is not None and lc.embed_threshold and not config.embeddings:
            return replace(lc, embed_threshold=0.0)
        return lc

    def _gate(self, table: SparseTable) -> None:
        """Wire `table`'s lazy-embedding gate to its gating table, looked up at
        each push (it may be declared later, or swapped by a restore)."""
        lc = table.lifecycle
        if not lc.embed_threshold or not table.config.embeddings:
            table.gate = None
            return
        source, threshold, tables = lc.embed_source(table.config.name), lc.embed_threshold, self.by_name

        def gate(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            scoring = tables.get(source)
            if scoring is None:
                return np.zeros(keys.size, dtype=bool)
            return scoring.key_scores(keys) >= threshold

        table.gate = gate

    def configure(self, config: TableConfig) -> bool:
        """`declare`, except that a table restored with another lifecycle
        takes this one (the shard's configuration is the operator's latest
        word; rows stay as they are). Returns True when anything changed."""
        existing = self.by_name.get(config.name)
        lifecycle = config.lifecycle if config.lifecycle is not None else self._default_for(config)
        if existing is None or existing.config.lifecycle == lifecycle:
            return self.declare(config)
        if not replace(existing.config, lifecycle=lifecycle).accepts(config):
            return self.declare(config)  # another shape: the conflict, worded
        existing.set_lifecycle(lifecycle)
        self._gate(existing)
        return True

    def drop(self, name: str) -> bool:
        """Remove table `name` and its rows (a deleted model's); True when it
        was held. Idempotent. Key sets naming it stop resolving when used
        (the push finds no table: `UnknownTableError`)."""
        self.configured = tuple(t for t in self.configured if t.name != name)
        return self.by_name.pop(name, None) is not None

    def table(self, name: str) -> SparseTable:
        """The table called `name`, or `UnknownTableError`."""
        try:
            return self.by_name[name]
        except KeyError:
            raise UnknownTableError(
                f"no table {name!r} on shard {self.spec.shard_id}; declared: {sorted(self.by_name)}"
            ) from None

    def check_owned(self, keys: npt.NDArray[np.uint64]) -> None:
        """`MovedError` (a `WrongShardError`) unless every key of `keys` is in
        a slot this shard owns by its slot map."""
        m = self.slot_map
        if keys.size == 0 or (m.num_shards == 1 and m.is_even):
            return
        wrong = m.owner_of(keys) != self.spec.shard_id
        if wrong.any():
            raise MovedError(
                f"{int(wrong.sum())} of {keys.size} keys belong to other shards, not shard "
                f"{self.spec.shard_id} of {m.num_shards} at slot map epoch {m.epoch} (first: {int(keys[wrong][0])})",
                m.epoch,
            )
