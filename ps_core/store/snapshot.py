"""Export cuts of a table: `TableSnapshot` (the rows of a base or a delta, as
copies) and `Cuts` (a table's export versions and what the next delta needs).

`Cuts.snapshot` is an export cut: copies of the live rows (a base) or of the
rows changed since the last cut plus the keys deleted since (a delta), after
which the open `version` moves on. `Cuts.mark_exported` and
`SparseTable.load_rows` are its inverse, for restores
(`ps_core.checkpoint.export_files`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError
from ..hashing import U64, sorted_distinct
from .lifecycle import CountSketch
from .row_meta import RowMeta, stored_shows
from .storage import F32, U32, RowStorage
from .table_config import TableConfig

__all__ = ["MAX_VERSION", "SnapshotKind", "TableSnapshot", "Cuts", "checked_rows"]

SnapshotKind = Literal["base", "delta"]
MAX_VERSION = 2**32 - 2
"""Highest export version: rows carry versions as uint32, and a cut at
`version` starts `version + 1`."""
_NO_KEYS = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, eq=False)
class TableSnapshot:
    """The rows of one table on one shard at an export cut, as copies it owns.

    A base holds every live row; a delta the live rows changed after `parent`
    and the keys deleted since then. Row ``i`` of every per-row array belongs
    to ``keys[i]``. (Not comparable with ``==``: compare the arrays.)
    """

    table: str
    """The table's name."""
    config: TableConfig
    """The table's declaration: dim, optimizer (so the row layout), initial values."""
    version: int
    """The export version this snapshot closes (every row's ``updated_at``)."""
    kind: SnapshotKind
    """``"base"`` (every live row) or ``"delta"`` (rows changed after `parent`)."""
    parent: int | None
    """For a delta, the version it applies on top of; None for a base."""
    keys: U64
    """(n,) uint64 feature ids, distinct."""
    data: F32
    """(n, dim * slots) float32: each row's weights and optimizer state (see `ps_core.store.optim`)."""
    updated_at: U32
    """(n,) the version of the cut that wrote each row (files of older writers: of its last change)."""
    last_seen: U32
    """(n,) event time of each row's last update, whole seconds."""
    shows: F32
    """(n,) impressions counted for each key, as stored: times `count_scale`
    they are the decayed counts (format 1 stored whole uint32 counts)."""
    clicks: F32
    """(n,) clicks counted for each key, stored as `shows` are."""
    deleted: U64
    """(m,) keys deleted since `parent` and absent at the cut (empty for a base).
    May name keys `parent` never held (inserted and deleted in between)."""
    count_scale: npt.NDArray[np.float64] = field(default_factory=lambda: np.ones(1))
    """(1,) the table's count scale at the cut (`SparseTable.count_scale`)."""
    sketch_cells: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """(c,) cells of the table's admission sketch (flat positions) set since
    `parent`, or every non-zero cell for a base (`ps_core.store.lifecycle.CountSketch`)."""
    sketch_values: npt.NDArray[np.uint8] = field(default_factory=lambda: np.zeros(0, np.uint8))
    """(c,) their values."""

    ARRAYS = (
        "keys",
        "data",
        "updated_at",
        "last_seen",
        "shows",
        "clicks",
        "deleted",
        "count_scale",
        "sketch_cells",
        "sketch_values",
    )
    """Names of the array fields, in file order."""
    OPTIONAL = frozenset({"count_scale", "sketch_cells", "sketch_values"})
    """Members a format 1 file does not have (their defaults: no decay, no sketch)."""

    def __post_init__(self) -> None:
        for name in ("shows", "clicks"):
            a = getattr(self, name)
            if a.dtype == np.uint32:  # format 1: whole counts
                object.__setattr__(self, name, a.astype(np.float32))
        n = self.keys.shape[0] if self.keys.ndim == 1 else -1
        width = self.config.row_rule().width(self.config.dim)
        expect: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
            "keys": (np.dtype(np.uint64), (n,)),
            "data": (np.dtype(np.float32), (n, width)),
            "updated_at": (np.dtype(np.uint32), (n,)),
            "last_seen": (np.dtype(np.uint32), (n,)),
            "shows": (np.dtype(np.float32), (n,)),
            "clicks": (np.dtype(np.float32), (n,)),
            "count_scale": (np.dtype(np.float64), (1,)),
            "sketch_values": (np.dtype(np.uint8), (self.sketch_cells.shape[0],)),
        }
        for name, (dtype, shape) in expect.items():
            a = getattr(self, name)
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(
                    f"snapshot of table {self.table}: {name} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}"
                )
        if self.deleted.dtype != np.uint64 or self.deleted.ndim != 1:
            raise ValueError(f"snapshot of table {self.table}: deleted must be 1-d uint64")
        if self.sketch_cells.dtype != np.int64 or self.sketch_cells.ndim != 1:
            raise ValueError(f"snapshot of table {self.table}: sketch_cells must be 1-d int64")
        scale = float(self.count_scale[0])
        if not 0 < scale <= 1:
            raise ValueError(f"snapshot of table {self.table}: count_scale {scale} is not in (0, 1]")
        if self.table != self.config.name:
            raise ValueError(f"snapshot names table {self.table}, its config {self.config.name}")
        if (self.kind == "base") != (self.parent is None):
            raise ValueError(f"a {self.kind} snapshot with parent {self.parent}")
        if self.kind == "base" and self.deleted.size:
            raise ValueError("a base snapshot has no deleted keys")
        if self.parent is not None and not 0 <= self.parent < self.version:
            raise ValueError(f"parent {self.parent} is not below version {self.version}")

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.keys.size)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays."""
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The arrays by field name, in `ARRAYS` order."""
        return {name: getattr(self, name) for name in self.ARRAYS}


class Cuts:
    """A table's export versions: the open one, the last cut, and what the
    next delta needs beside the flagged rows (the keys deleted since the
    cut, the admission sketch at it)."""

    def __init__(self, storage: RowStorage, meta: RowMeta) -> None:
        self._storage = storage
        self._meta = meta
        self.version = 1
        """The open export version: the cut closing it carries the rows changed now."""
        self.last_snapshot = 0
        """The version of the last cut (`snapshot`, or a restore's `mark_exported`);
        0, the empty table, before any. A delta is always taken relative to it."""
        # Keys deleted since the last cut, for the next delta. Kept as the
        # arrays a delete returned; folded into one distinct array when they
        # have doubled, so the log holds each deleted key about once.
        self._deleted: list[U64] = []
        self._deleted_len = 0
        self._deleted_fold_at = 1024
        self.sketch_at_cut: npt.NDArray[np.uint8] | None = None
        """The admission sketch's cells at the last cut (None without a sketch)."""

    def deleted(self, gone: U64) -> None:
        """Log keys just deleted, for the next delta."""
        # Before any cut (or restore) the next delta's parent is the empty
        # table, which held none of them: nothing to log. So a shard that
        # never exports keeps no log that grows with what it evicts.
        if gone.size and self.last_snapshot > 0:
            self._deleted.append(gone)
            self._deleted_len += int(gone.size)
            if self._deleted_len >= 2 * self._deleted_fold_at:
                folded = sorted_distinct(np.concatenate(self._deleted))
                self._deleted, self._deleted_len = [folded], int(folded.size)
                self._deleted_fold_at = max(1024, self._deleted_len)

    def snapshot(
        self, config: TableConfig, sketch: CountSketch | None, since: int | None, version: int | None
    ) -> TableSnapshot:
        """Cut export `version` (see `SparseTable.snapshot`)."""
        if since is not None and since != self.last_snapshot:
            raise ValueError(
                f"table {config.name}: a delta must follow the last cut "
                f"(version {self.last_snapshot}), not version {since}"
            )
        live = self._storage.index.row_live
        sel = live if since is None else live & self._meta.changed()
        deleted = _NO_KEYS if since is None else self._deleted_since_cut()
        cut = self.version if version is None else version
        snap = self._copy_rows(config, sketch, np.flatnonzero(sel), cut, since, deleted)
        # The cut's number, not the open version: after a cut at MAX_VERSION
        # the open one is past any a cut may take.
        self.mark_exported(cut, sketch)
        return snap

    def base_copy(self, config: TableConfig, sketch: CountSketch | None, version: int) -> TableSnapshot:
        """Every live row as a base labelled `version`, without cutting (see `SparseTable.base_copy`)."""
        n = self._storage.num_rows
        rows = np.flatnonzero(self._storage.index.row_live[:n])
        return self._copy_rows(config, sketch, rows, version, None, _NO_KEYS, base=True)

    def copy_selected(
        self, config: TableConfig, select: Callable[[U64], npt.NDArray[np.bool_]], version: int
    ) -> TableSnapshot:
        """The live rows whose keys `select` picks, as a base labelled
        `version`, without cutting and without the admission sketch (see
        `SparseTable.rows_where`)."""
        n = self._storage.num_rows
        live = np.flatnonzero(self._storage.index.row_live[:n])
        rows = live[select(self._storage.index.row_keys[live])]
        return self._copy_rows(config, None, rows, version, None, _NO_KEYS, base=True)

    def _sketch_cells(
        self, sketch: CountSketch | None, parent: int | None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
        """The admission sketch's cells for a snapshot: those set since the
        last cut for a delta, the non-zero ones for a base."""
        if sketch is None:
            return np.zeros(0, np.int64), np.zeros(0, np.uint8)
        flat = sketch.cells.reshape(-1)
        if parent is None or self.sketch_at_cut is None:
            cells = np.flatnonzero(flat)
        else:
            cells = np.flatnonzero(flat != self.sketch_at_cut.reshape(-1))
        return cells.astype(np.int64), flat[cells]

    def _copy_rows(
        self,
        config: TableConfig,
        sketch: CountSketch | None,
        rows: npt.NDArray[np.intp],
        version: int,
        parent: int | None,
        deleted: U64,
        *,
        base: bool = False,
    ) -> TableSnapshot:
        storage = self._storage
        if rows.size == storage.num_rows:
            # Every row handed out is selected (no freed rows): a slice copy
            # is a straight memcpy, cheaper than a gather.
            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return a[: rows.size].copy()
        else:

            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return np.take(a, rows, axis=0)

        cells, values = self._sketch_cells(sketch, None if base else parent)
        return TableSnapshot(
            table=config.name,
            config=config,
            version=version,
            kind="base" if parent is None else "delta",
            parent=parent,
            keys=take(storage.index.row_keys),
            data=take(storage.data),
            # The flag says only "since the last cut": every row a cut
            # writes is labelled with its version.
            updated_at=np.full(rows.size, version, dtype=np.uint32),
            last_seen=take(self._meta.last_seen),
            shows=stored_shows(take(storage.meta[:, 1])),
            clicks=take(self._meta.clicks),
            deleted=deleted,
            count_scale=np.array([self._meta.count_scale]),
            sketch_cells=cells,
            sketch_values=values,
        )

    def _deleted_since_cut(self) -> U64:
        """Distinct keys deleted since the last cut that have no row now."""
        if not self._deleted:
            return _NO_KEYS.copy()
        keys = sorted_distinct(np.concatenate(self._deleted))
        absent: U64 = keys[self._storage.index.lookup(keys) < 0]
        return absent

    def mark_exported(self, version: int, sketch: CountSketch | None) -> None:
        """Declare the table's content to be export `version` (see `SparseTable.mark_exported`)."""
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version {version} outside [0, 2**32 - 1)")
        self.last_snapshot = version
        self.version = version + 1
        self._deleted, self._deleted_len, self._deleted_fold_at = [], 0, 1024
        self._meta.clear_changed()  # nothing changed since this cut
        if self.sketch_at_cut is not None and sketch is not None:
            self.sketch_at_cut[...] = sketch.cells

    def load_counts(
        self, table: str, sketch: CountSketch | None, count_scale: float, cells: npt.ArrayLike, values: npt.ArrayLike
    ) -> None:
        """A snapshot's count scale and admission-sketch cells (see `SparseTable.load_counts`)."""
        if not 0 < count_scale <= 1:
            raise InvalidValuesError(f"table {table}: count_scale {count_scale} is not in (0, 1]")
        self._meta.count_scale = float(count_scale)
        at = np.asarray(cells, dtype=np.int64)
        if sketch is None or not at.size:
            return
        flat = sketch.cells.reshape(-1)
        if at.min() < 0 or at.max() >= flat.size:
            # Another sketch size (the lifecycle changed): its counts do not map.
            return
        flat[at] = np.asarray(values, dtype=np.uint8)


def checked_rows(
    table: str, width: int, keys: npt.ArrayLike, data: npt.ArrayLike, meta: tuple[npt.ArrayLike, ...]
) -> tuple[U64, F32, list[npt.NDArray[Any]]]:
    """Whole rows to load (`SparseTable.load_rows`) as arrays: keys, data
    (n, `width`) and the metadata (updated_at, last_seen, shows, clicks);
    raises `InvalidValuesError` for any bad one."""
    k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
    n = k.size
    d = np.asarray(data, dtype=np.float32)
    m = [np.asarray(a).reshape(-1) for a in meta]
    if d.shape != (n, width):
        raise InvalidValuesError(f"table {table}: rows of shape {d.shape}, expected ({n}, {width})")
    if any(a.shape != (n,) for a in m):
        raise InvalidValuesError(f"table {table}: metadata arrays must hold {n} values each")
    if any(a.size and (a.min() < 0 or a.max() >= 2**32) for a in m[:2]):
        raise InvalidValuesError(f"table {table}: updated_at and last_seen must be in [0, 2**32)")
    if any(a.size and not (a.min() >= 0 and np.isfinite(a).all()) for a in m[2:]):
        raise InvalidValuesError(f"table {table}: shows and clicks must be finite and >= 0")
    if not np.isfinite(d).all():
        raise InvalidValuesError(f"table {table}: rows hold NaN or inf")
    return k, d, m
