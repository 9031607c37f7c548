"""Restoring export versions into shards of any count: a chain (a base and
its deltas) into fresh or given shards (`restore_into`, `restore_shards`),
or one version read into memory onto what shards hold (`apply_version`).
Keys are re-hashed with `shard_of`, so the shard count may differ from the
writer's. Synchronous: callers run it in a thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError, TableConflictError
from ..shard import Shard, ShardSpec
from ..store.snapshot import TableSnapshot
from .export_files import (
    LoadedVersion,
    VersionInfo,
    manifest_snapshots,
    serving_manifest,
)
from .manifest import (
    ExportManifest,
    Offsets,
)

__all__ = ["RestoreResult", "restore_into", "restore_shards", "apply_version"]


@dataclass(frozen=True)
class RestoreResult:
    """What a restore built and where the workers resume."""

    shards: list[Shard]
    """The restored shards, in the order asked for."""
    version: int
    """The chain's last version: each table's open version is one above it."""
    offsets: Offsets
    """The last manifest's offsets: seek every partition there."""
    manifest: ExportManifest
    """The last manifest (model config, table declarations)."""


def _check_chain(chain: Sequence[VersionInfo]) -> None:
    if not chain:
        raise ValueError("an empty chain")
    if chain[0].kind != "base":
        raise ValueError(f"a chain starts with a base, not a {chain[0].kind} ({chain[0].location})")
    for prev, cur in zip(chain, chain[1:]):
        if cur.kind != "delta" or cur.parent != prev.version:
            raise ValueError(f"version {cur.version} ({cur.kind}, parent {cur.parent}) does not follow {prev.version}")


def _route(keys: npt.NDArray[np.uint64], shards: Sequence[Shard]) -> list[npt.NDArray[np.intp] | None]:
    """For each target shard, the positions of its keys by the shards' slot
    map (None: all of them)."""
    slots = shards[0].slot_map
    if slots.num_shards == 1:
        return [None]
    owner = slots.owner_of(keys)
    # One comparison per target: cheaper than sorting by owner for the
    # handful of shards a restore builds, and it serves a subset of shards.
    return [np.flatnonzero(owner == s.spec.shard_id) for s in shards]


def _apply(snap: TableSnapshot, shards: Sequence[Shard], source: int, sources: int) -> None:
    """Upsert a snapshot's rows (written by shard `source` of `sources`) into
    the shards owning them; its deleted keys are `_delete`'s, once every
    snapshot of the version is upserted.

    Into as many shards as wrote it, shard `source` also takes the
    snapshot's count scale and admission-sketch cells, so it reads exactly
    the counts the writer did. Into another shard count, rows from shards
    with different scales meet: their counts are stored decayed (times the
    scale of their version, which leaves out the decays after it) and the
    sketch's candidate counts start over, as the keys behind its cells are
    not known."""
    same = shards[0].spec.num_shards == sources
    scale = float(snap.count_scale[0])
    shows, clicks = snap.shows, snap.clicks
    if not same and scale != 1.0:
        shows, clicks = (shows * np.float32(scale), clicks * np.float32(scale))
    arrays = (snap.data, snap.updated_at, snap.last_seen, shows, clicks)
    for shard, sel in zip(shards, _route(snap.keys, shards)):
        table = shard.tables[snap.table]
        if sel is None:
            table.load_rows(snap.keys, *arrays)
        elif sel.size:
            table.load_rows(snap.keys[sel], *(a[sel] for a in arrays))
    for shard in shards:
        if same and shard.spec.shard_id == source:
            shard.tables[snap.table].load_counts(scale, snap.sketch_cells, snap.sketch_values)


class _Deletions:
    """A version's deleted keys, applied after all its rows: a key one shard
    deleted and another upserted in the same version moved between them (a
    slot move), and its row stays."""

    def __init__(self) -> None:
        self._deleted: dict[str, list[npt.NDArray[np.uint64]]] = {}
        self._upserted: dict[str, list[npt.NDArray[np.uint64]]] = {}

    def note(self, snap: TableSnapshot) -> None:
        if snap.kind != "delta":
            return  # a base deletes nothing
        self._upserted.setdefault(snap.table, []).append(snap.keys)
        if snap.deleted.size:
            self._deleted.setdefault(snap.table, []).append(snap.deleted)

    def apply(self, shards: Sequence[Shard]) -> None:
        for table, parts in self._deleted.items():
            deleted = np.concatenate(parts)
            deleted = deleted[~np.isin(deleted, np.concatenate(self._upserted[table]))]
            for shard, sel in zip(shards, _route(deleted, shards)):
                shard.tables[table].delete(deleted if sel is None else deleted[sel])


def restore_into(
    shards: Sequence[Shard], chain: Sequence[VersionInfo], *, verify: bool = True, serving: bool = False
) -> RestoreResult:
    """Load a chain (base, then each delta) into shards of any count.

    The shards must share one `num_shards` and have distinct ids; they may be
    any subset of the cluster (a shard server restores its own slice). Into
    as many shards as the chain's last cut, the shards take its slot map (so
    each slot is where it was); into another count, their own (the even
    map of that count). Each key goes to its slot's shard; each version's
    rows are upserted (state and metadata as stored), then its deleted keys
    removed. Tables are declared
    from the manifests (a conflicting declaration is a `TableConflictError`).
    Afterwards every table of the chain has ``version = last + 1`` and the
    next delta is taken relative to the last version.
    """
    _check_chain(chain)
    if not shards:
        raise ValueError("no shards to restore into")
    if len({s.spec.num_shards for s in shards}) != 1 or len({s.spec.shard_id for s in shards}) != len(shards):
        raise ValueError("shards must share num_shards and have distinct ids")
    cut = chain[-1].manifest.cut_slots()
    if cut.num_shards == shards[0].spec.num_shards:
        for shard in shards:
            shard.adopt_slot_map(cut)  # the even map of epoch 1 is what they hold already
    declared: set[str] = set()
    for info in chain:
        # The chain's own manifests, not re-read ones: were a version swapped
        # by a compaction since the chain was listed, its files no longer
        # match and the load fails instead of mixing a base into the chain.
        tables = serving_manifest(info.manifest).tables if serving else info.manifest.tables
        for config in tables.values():
            for shard in shards:
                shard.declare(config)
            declared.add(config.name)
        deletions = _Deletions()
        for source, snap in manifest_snapshots(info.source, info.manifest, verify, serving):
            _apply(snap, shards, source, info.manifest.num_shards)
            deletions.note(snap)
        deletions.apply(shards)
    last = chain[-1]
    for shard in shards:
        for name in declared:
            shard.tables[name].mark_exported(last.version)
    return RestoreResult(list(shards), last.version, last.manifest.offsets, last.manifest)


def restore_shards(
    chain: Sequence[VersionInfo],
    num_shards: int,
    shard_ids: Sequence[int] | None = None,
    *,
    verify: bool = True,
) -> RestoreResult:
    """Fresh shards ``shard_ids`` (default all) of a `num_shards` cluster,
    restored from a chain (see `restore_into`)."""
    ids = range(num_shards) if shard_ids is None else shard_ids
    shards = [Shard(ShardSpec(i, num_shards)) for i in ids]
    return restore_into(shards, chain, verify=verify)


def apply_version(shards: Sequence[Shard], loaded: LoadedVersion) -> None:
    """Apply one version read into memory (`load_version`) on top of what
    shards of any count hold: a base into shards that hold none of its
    tables' rows, a delta onto its parent (every table's last version).

    Everything is checked before anything changes (declarations, parents,
    finite rows), so a refused version leaves the shards as they were: a
    `TableConflictError`, `InvalidValuesError` or `ValueError`. Afterwards
    the tables are marked exported at the version (`SparseTable.mark_exported`).
    """
    m = loaded.manifest
    for shard in shards:
        for config in m.tables.values():
            table = shard.tables.get(config.name)
            if table is not None and table.config != config:
                raise TableConflictError(
                    f"version {m.version} declares table {config.name} as {config.to_dict()}, "
                    f"shard {shard.spec.shard_id} holds {table.config.to_dict()}"
                )
            held = 0 if table is None else table.last_snapshot
            if m.kind == "delta" and held != m.parent:
                raise ValueError(
                    f"version {m.version} is a delta of {m.parent}; table {config.name} "
                    f"on shard {shard.spec.shard_id} holds version {held}"
                )
            if m.kind == "base" and table is not None and len(table):
                raise ValueError(f"base {m.version} into table {config.name}, which holds rows")
    snaps = [(source, s) for source, part in loaded.snapshots.items() for s in part]
    for _, snap in snaps:
        if not np.isfinite(snap.data).all():
            raise InvalidValuesError(f"version {m.version}, table {snap.table}: rows hold NaN or inf")
    for shard in shards:
        for config in m.tables.values():
            shard.declare(config)
    deletions = _Deletions()
    for source, snap in snaps:
        _apply(snap, shards, source, m.num_shards)
        deletions.note(snap)
    deletions.apply(shards)
    for shard in shards:
        for name in m.tables:
            shard.tables[name].mark_exported(m.version)
