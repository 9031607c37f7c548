"""What a serving replica holds: a model's export versions in read-only
tables (`ReplicaTables`, over `ps_core.replica.read_table.ReadTable`).

A replica needs the weights and nothing else: no optimizer state, no
lifecycle metadata, no room for inserts between versions. It applies a base
and then each delta, whole versions only: every table's rows of a version
are checked (finite, no key twice, the delta's parent is the version held,
the declarations agree) before any table changes, so a refused version
leaves the replica serving what it had.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..checkpoint.export_files import LoadedVersion
from ..checkpoint.serving_files import serving_config
from ..errors import TableConflictError, UnknownTableError
from ..hashing import U64
from ..store.storage import F32
from ..store.table import SparseTable
from .read_table import Prepared, ReadTable, State

__all__ = ["ReplicaTables", "Staged"]


class Staged(NamedTuple):
    """A version checked and built beside the served tables (`ReplicaTables.stage`)."""

    version: int
    tables: dict[str, ReadTable]
    """Every table of the version (held ones, and new ones not yet served)."""
    states: dict[str, State]
    """The tables' states after the version (tables it has no rows of keep theirs)."""


class ReplicaTables:
    """A model's tables as one replica serves them, at one export version."""

    def __init__(self, precision: str = "f32") -> None:
        self.precision = precision
        """What the weights are held in (the versions' serving precision)."""
        self.tables: dict[str, ReadTable] = {}
        self.version: int | None = None
        """The last version applied; None before the base."""
        # Per table, an empty trainer's table: the shape of the lifecycle and
        # staleness figures the API reads (a replica evicts nothing, applies no push).
        self._empty: dict[str, SparseTable] = {}

    def apply(self, loaded: LoadedVersion, *, serving: bool) -> None:
        """Apply a version read into memory: a base into empty tables, a
        delta onto its parent (`stage`, then `install`)."""
        self.install(self.stage(loaded, serving=serving))

    def stage(self, loaded: LoadedVersion, *, serving: bool) -> Staged:
        """Check a version and build every table's state after it, beside the
        served ones (run it in a thread: a delta is a merge of every row held).
        `serving`: it was read from serving files (weights); else from data
        files (optimizer state, read as weights). Changes nothing."""
        m = loaded.manifest
        if m.kind == "base" and self.version is not None:
            raise ValueError(f"base {m.version} onto version {self.version}: a base loads into fresh tables")
        if m.kind == "delta" and m.parent != self.version:
            raise ValueError(f"version {m.version} is a delta of {m.parent}; the replica holds {self.version}")
        configs = {name: serving_config(c) if serving else c for name, c in m.tables.items()}
        for name, config in configs.items():
            held = self.tables.get(name)
            if held is not None and held.config != config:
                raise TableConflictError(
                    f"version {m.version} declares table {name} as {config.to_dict()}, "
                    f"the replica holds {held.config.to_dict()}"
                )
        by_table: dict[str, list[Any]] = {}
        for part in loaded.snapshots.values():
            for snap in part:
                by_table.setdefault(snap.table, []).append(snap)
        tables = {name: self.tables.get(name) or ReadTable(config, self.precision) for name, config in configs.items()}
        prepared: dict[str, Prepared] = {}
        for name, snaps in by_table.items():
            table = tables[name]
            weights = [s.config.row_rule().weights(s.data, table.dim) for s in snaps]
            prepared[name] = table.prepare(
                np.concatenate([s.keys for s in snaps]),
                np.concatenate(weights) if weights else np.zeros((0, table.dim), np.float32),
                np.concatenate([s.deleted for s in snaps]),
            )
        states = {name: tables[name].staged(p) for name, p in prepared.items()}
        return Staged(m.version, tables, states)

    def install(self, staged: Staged) -> None:
        """Serve a staged version: every table's state and the version, in
        one synchronous step (no read sees two versions)."""
        for name, table in staged.tables.items():
            state = staged.states.get(name)
            if state is not None:
                table.install(state)
            table.version = staged.version
            self.tables[name] = table
        self.version = staged.version

    def table(self, name: str) -> ReadTable:
        """The table `name`; `UnknownTableError` when no version declared it."""
        t = self.tables.get(name)
        if t is None:
            raise UnknownTableError(f"unknown table {name!r}")
        return t

    def handle_pull(self, table: str, keys: U64) -> tuple[F32, int]:
        """Weights of `keys` and the version held."""
        t = self.table(table)
        return t.pull(keys), t.version

    def contains(self, table: str, keys: U64) -> np.ndarray:
        """Whether each key has a row."""
        return self.table(table).contains(keys)

    def stats(self) -> dict[str, Any]:
        """Features and bytes per table, in the shape of a shard's stats."""
        out: dict[str, Any] = {}
        for name, t in self.tables.items():
            empty = self._empty.get(name)
            if empty is None or empty.config != t.config:
                empty = self._empty[name] = SparseTable(t.config, initial_rows=16)
            out[name] = {
                "features": len(t),
                "bytes": t.memory_bytes(),
                "pushes": 0,
                "pulls": t.pulls,
                "version": t.version,
                "config": t.config.to_dict(),
                "lifecycle": empty.lifecycle_stats(),
                "staleness": empty.staleness.stats(),
                "precision": t.precision,
            }
        return {"shard_id": 0, "num_shards": 1, "duplicate_pushes": 0, "tables": out}
