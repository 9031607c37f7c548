"""Exports: snapshots and deletions, the files and manifest, checksums,
atomic visibility, restore into another shard count, compaction, retention,
and the numpy-only reader of docs/export-format.md."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import ps_core.checkpoint.export_files as export
from ps_core.checkpoint.export_files import (
    latest_chain,
    list_versions,
    load_version,
    read_manifest,
    verify_version,
    write_version,
)
from ps_core.checkpoint.restore import restore_shards
from ps_core.checkpoint.retention import compact, prune
from ps_core.errors import ExportCorruptError, ExportNotFoundError, InvalidValuesError
from ps_core.hashing import shard_of
from ps_core.net.client import PSClient
from ps_core.shard import Push, Shard, ShardSpec
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

LR = TableConfig("lr", 1, {"name": "ftrl", "alpha": 0.1, "l1": 0.01})
FM = TableConfig("fm_v", 4, {"name": "adagrad", "lr": 0.05}, init_scale=0.01, seed=7)
TABLES = (LR, FM)
MODEL_CONFIG = {"model": "fm", "namespace": "ctr", "tables": ["lr", "fm_v"]}
META = ("last_seen", "shows", "clicks")
"""The per-row metadata a table keeps (a cut labels its rows with its version:
`updated_at`, checked apart)."""

U64 = npt.NDArray[np.uint64]


# -- helpers -----------------------------------------------------------------------


def make_shards(n: int) -> list[Shard]:
    return [Shard(ShardSpec(i, n), TABLES) for i in range(n)]


def push(shards: list[Shard], keys: U64, rng: np.random.Generator, event_time: float) -> None:
    """Train every table on `keys` (routed to their shards), with counts."""
    owner = shard_of(keys, len(shards))
    for shard in shards:
        mine = keys[owner == shard.spec.shard_id]
        if not mine.size:
            continue
        counts = np.stack([np.ones(mine.size), rng.integers(0, 2, mine.size)], axis=1)
        for t in TABLES:
            grads = rng.normal(size=(mine.size, t.dim)).astype(np.float32)
            shard.handle_push(Push(t.name, mine, grads, counts.astype(np.float32), event_time))


def delete(shards: list[Shard], keys: U64) -> None:
    owner = shard_of(keys, len(shards))
    for shard in shards:
        for t in shard.tables.values():
            t.delete(keys[owner == shard.spec.shard_id])


def cut(shards: list[Shard], since: int | None) -> dict[int, list[TableSnapshot]]:
    return {s.spec.shard_id: [t.snapshot(since) for t in s.tables.values()] for s in shards}


def rows_of(shards: list[Shard], table: str) -> dict[str, np.ndarray]:
    """Every live row of a table over the shards, sorted by key, read straight
    from the table's arrays (not through a snapshot)."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("keys", "data", *META)}
    for s in shards:
        t = s.tables[table]
        rows = np.flatnonzero(t.index.row_live[: t.index.num_rows])
        parts["keys"].append(t.index.row_keys[rows])
        parts["data"].append(t.data[rows])
        for m in META:
            parts[m].append(getattr(t, m)[rows])
    out = {k: np.concatenate(v) for k, v in parts.items()}
    order = np.argsort(out["keys"])
    return {k: v[order] for k, v in out.items()}


def assert_same_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a["keys"].size == b["keys"].size
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def snapshot_rows(snap: TableSnapshot) -> dict[str, np.ndarray]:
    assert (snap.updated_at == snap.version).all()
    order = np.argsort(snap.keys)
    return {k: getattr(snap, k)[order] for k in ("keys", "data", *META)}


def build_chain(root: Path, rng: np.random.Generator) -> tuple[list[Shard], U64]:
    """Two source shards; base 1, delta 2 (with deletions), delta 3 written
    under root/ctr. Returns the shards (at open version 4) and the deleted keys."""
    shards = make_shards(2)
    universe = np.unique(rng.integers(0, 2**64, size=3100, dtype=np.uint64))[:3000]
    rng.shuffle(universe)
    push(shards, universe[:2000], rng, 1_000)
    offsets: dict[str, dict[int, int]] = {"clicks": {0: 10, 1: 12}}
    write_version(root, "ctr", 1, None, cut(shards, None), offsets, MODEL_CONFIG, 2)
    push(shards, universe[1500:2500], rng, 2_000)  # updates and inserts
    gone = universe[:300]
    delete(shards, gone)
    push(shards, universe[100:150], rng, 2_001)  # deleted, then inserted again
    offsets = {"clicks": {0: 20, 1: 25}}
    write_version(root, "ctr", 2, 1, cut(shards, 1), offsets, MODEL_CONFIG, 2)
    push(shards, universe[2400:3000], rng, 3_000)
    delete(shards, universe[2000:2050])
    offsets = {"clicks": {0: 31, 1: 40}, "clicks.more": {0: 5}}
    write_version(root, "ctr", 3, 2, cut(shards, 2), offsets, MODEL_CONFIG, 2)
    deleted = np.concatenate([universe[:100], universe[150:300], universe[2000:2050]])
    return shards, deleted


# -- snapshots -----------------------------------------------------------------------


def test_snapshot_base_then_delta_and_the_version_advances() -> None:
    rng = np.random.default_rng(1)
    t = SparseTable(FM)
    first = np.arange(1, 101, dtype=np.uint64)
    t.push(first, rng.normal(size=(100, 4)), counts=np.ones((100, 2)), event_time=50)
    assert (t.version, t.last_snapshot) == (1, 0)
    base = t.snapshot(None)
    assert (base.kind, base.version, base.parent, base.rows) == ("base", 1, None, 100)
    assert (t.version, t.last_snapshot) == (2, 1)
    assert base.deleted.size == 0 and base.table == "fm_v" and base.config == FM
    assert_same_rows(snapshot_rows(base), rows_of(_one(t), "fm_v"))

    # Version 2: 10 old keys change, 5 new ones appear.
    changed = np.concatenate([first[:10], np.arange(1000, 1005, dtype=np.uint64)])
    t.push(changed, rng.normal(size=(15, 4)), event_time=60)
    before = base.data.copy()
    delta = t.snapshot(1)
    assert (delta.kind, delta.version, delta.parent, t.version) == ("delta", 2, 1, 3)
    assert sorted(delta.keys.tolist()) == sorted(changed.tolist())
    assert set(delta.updated_at.tolist()) == {2} and set(delta.last_seen.tolist()) == {60}
    rows = t.index.lookup(delta.keys)
    np.testing.assert_array_equal(delta.data, t.data[rows])
    np.testing.assert_array_equal(base.data, before)  # the base is a copy

    # A snapshot's arrays do not follow later pushes.
    t.push(changed, rng.normal(size=(15, 4)), event_time=70)
    assert not np.array_equal(delta.data, t.data[rows])
    # A delta must follow the last cut; an unchanged table cuts an empty delta.
    with pytest.raises(ValueError, match="last cut"):
        t.snapshot(1)
    assert t.snapshot(2).rows == 15
    empty = t.snapshot(3)
    assert (empty.rows, empty.deleted.size, empty.version, t.version) == (0, 0, 4, 5)


def _one(t: SparseTable) -> list[Shard]:
    """A shard holding exactly table `t` (for `rows_of`)."""
    s = Shard(ShardSpec(0, 1))
    s.tables[t.config.name] = t
    return [s]


def test_deltas_list_deletions_but_not_keys_inserted_again() -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd"}))
    keys = np.arange(1, 11, dtype=np.uint64)
    t.push(keys, np.ones(10, dtype=np.float32))
    base = t.snapshot()
    t.delete(np.array([2, 3, 4], dtype=np.uint64))
    t.push(np.array([4], dtype=np.uint64), np.ones(1, dtype=np.float32))  # back again
    t.push(np.array([77], dtype=np.uint64), np.ones(1, dtype=np.float32))  # new ...
    t.delete(np.array([77, 555], dtype=np.uint64))  # ... and gone; 555 never existed
    delta = t.snapshot(base.version)
    assert sorted(delta.deleted.tolist()) == [2, 3, 77]
    assert delta.keys.tolist() == [4]
    assert t.snapshot(delta.version).deleted.size == 0  # the log starts afresh
    t.delete(np.array([5], dtype=np.uint64))
    assert t.snapshot(None).deleted.size == 0  # a base has no deletions ...
    assert t.snapshot(t.last_snapshot).deleted.size == 0  # ... and clears the log


def test_replaying_every_delta_rebuilds_the_table() -> None:
    """Random pushes and deletes (enough deletions to fold the log) between
    cuts; base + deltas applied to a dict always equals the table."""
    rng = np.random.default_rng(5)
    t = SparseTable(TableConfig("lr", 2, {"name": "adagrad"}))
    model: dict[int, tuple[Any, ...]] = {}
    universe = np.arange(1, 6000, dtype=np.uint64)
    since: int | None = None
    for step in range(12):
        for op in range(6):
            keys = rng.choice(universe, size=int(rng.integers(1, 800)), replace=False)
            # The base holds the first 3000 keys; the next interval deletes
            # them in three calls, past the point where the log folds.
            scripted = (step, op) == (0, 5) or (step == 1 and op < 3)
            if scripted:
                keys = universe[:3000] if step == 0 else universe[1000 * op : 1000 * (op + 1)]
            if (step, op) == (0, 5) or (not scripted and rng.random() < 0.6):
                t.push(
                    keys,
                    rng.normal(size=(keys.size, 2)).astype(np.float32),
                    event_time=float(rng.integers(1, 1_000_000)),
                )
            else:
                t.delete(keys)
        snap = t.snapshot(since)
        if snap.kind == "base":
            model.clear()
        for i, k in enumerate(snap.keys.tolist()):
            model[k] = (snap.data[i].tolist(), *(int(getattr(snap, m)[i]) for m in META))
        for k in snap.deleted.tolist():
            model.pop(k, None)  # may name a key inserted and deleted between cuts
        assert not np.isin(snap.deleted, snap.keys).any()
        since = snap.version if rng.random() < 0.85 else None
        live = rows_of(_one(t), "lr")
        assert sorted(model) == live["keys"].tolist()
        for i, k in enumerate(live["keys"].tolist()):
            assert model[k] == (live["data"][i].tolist(), *(int(live[m][i]) for m in META))


def test_load_rows_refuses_bad_input_and_changes_nothing() -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd"}))
    t.push(np.array([1, 2], dtype=np.uint64), np.ones(2, dtype=np.float32))
    before = rows_of(_one(t), "lr")
    meta = [np.zeros(3, dtype=np.uint32)] * 4
    with pytest.raises(InvalidValuesError, match="distinct"):
        t.load_rows(np.array([5, 6, 5], dtype=np.uint64), np.ones((3, 1), np.float32), *meta)
    with pytest.raises(InvalidValuesError, match="distinct"):
        t.load_rows(np.array([1, 6, 1], dtype=np.uint64), np.ones((3, 1), np.float32), *meta)
    with pytest.raises(InvalidValuesError, match="NaN"):
        t.load_rows(np.array([5, 6, 7], dtype=np.uint64), np.full((3, 1), np.nan, np.float32), *meta)
    with pytest.raises(InvalidValuesError, match="shape"):
        t.load_rows(np.array([5, 6, 7], dtype=np.uint64), np.ones((3, 2), np.float32), *meta)
    assert len(t) == 2
    assert_same_rows(rows_of(_one(t), "lr"), before)
    assert t.pull(np.array([5, 6], dtype=np.uint64)).tolist() == [[0.0], [0.0]]


# -- files ------------------------------------------------------------------------------


def test_write_then_load_is_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    shards, _ = build_chain(tmp_path, rng)
    mdir = tmp_path / "ctr"
    assert sorted(p.name for p in mdir.iterdir()) == ["0000000001", "0000000002", "0000000003"]
    # Cut version 4 and keep the snapshots to compare with what is read back.
    push(shards, rng.integers(0, 2**64, size=500, dtype=np.uint64), rng, 4_000)
    delete(shards, rows_of(shards, "lr")["keys"][:40])
    snaps = cut(shards, 3)
    t0 = datetime.now(UTC)
    path = write_version(tmp_path, "ctr", 4, 3, snaps, {"clicks": {3: 7, 0: 50}}, MODEL_CONFIG, 2)
    assert path == mdir / "0000000004"

    loaded = load_version(path)
    m = loaded.manifest
    assert (m.model, m.version, m.parent, m.kind, m.num_shards) == ("ctr", 4, 3, "delta", 2)
    assert m.model_config == MODEL_CONFIG and m.offsets == {"clicks": {0: 50, 3: 7}}
    assert m.tables == {"lr": LR, "fm_v": FM} and m.compacted_from == ()
    assert m.created_at.tzinfo is not None and abs(m.created_at - t0) < timedelta(seconds=30)
    assert sorted(f.name for f in m.files) == [f"shard-{i}.{t}.npz" for i in (0, 1) for t in ("fm_v", "lr")]
    for f in m.files:
        raw = (path / f.name).read_bytes()
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (f.bytes, f.sha256)
    assert m.deleted() == 2 * 40 and m.rows() == sum(s.rows for v in snaps.values() for s in v)
    for shard, written in snaps.items():
        by_table = {s.table: s for s in loaded.snapshots[shard]}
        for s in written:
            got = by_table[s.table]
            assert (got.version, got.kind, got.parent, got.config) == (4, "delta", 3, s.config)
            for name in TableSnapshot.ARRAYS:
                a, b = getattr(s, name), getattr(got, name)
                assert a.dtype == b.dtype, name
                np.testing.assert_array_equal(a, b, err_msg=name)

    raw = json.loads((path / "manifest.json").read_text())
    assert raw["created_at"].endswith("Z") and raw["offsets"] == {"clicks": {"0": 50, "3": 7}}
    with pytest.raises(FileExistsError):
        write_version(tmp_path, "ctr", 4, 3, snaps, {}, MODEL_CONFIG, 2)


def test_data_files_hold_exactly_what_np_savez_writes(tmp_path: Path) -> None:
    """The writer streams arrays itself (no copies); its members must still be
    byte for byte what np.savez writes, including empty and 2-d arrays."""

    arrays = {
        "keys": np.arange(300_000, dtype=np.uint64) * np.uint64(2**40),
        "data": np.arange(12, dtype=np.float32).reshape(6, 2),
        "wide": np.ones((3, 0), dtype=np.float32),
        "deleted": np.zeros(0, dtype=np.uint64),
    }
    size, digest = export._write_npz(tmp_path / "ours.npz", arrays)
    raw = (tmp_path / "ours.npz").read_bytes()
    assert (size, digest) == (len(raw), hashlib.sha256(raw).hexdigest())
    np.savez(tmp_path / "numpy.npz", allow_pickle=False, **arrays)
    with zipfile.ZipFile(tmp_path / "ours.npz") as ours, zipfile.ZipFile(tmp_path / "numpy.npz") as ref:
        assert ours.namelist() == ref.namelist()
        for name in ref.namelist():
            assert ours.read(name) == ref.read(name), name
    with pytest.raises(FileExistsError):  # never overwrites
        export._write_npz(tmp_path / "ours.npz", arrays)


def test_write_version_refuses_what_is_not_one_cut(tmp_path: Path) -> None:
    shards = make_shards(2)
    push(shards, np.arange(50, dtype=np.uint64), np.random.default_rng(0), 1)
    snaps = cut(shards, None)  # version 1 bases
    with pytest.raises(ValueError, match="shards 0..2"):
        write_version(tmp_path, "m", 1, None, snaps, {}, {}, 3)
    with pytest.raises(ValueError, match="a base of version 1"):
        write_version(tmp_path, "m", 2, 1, snaps, {}, {}, 2)
    with pytest.raises(ValueError, match="model name"):
        write_version(tmp_path, ".hidden", 1, None, snaps, {}, {}, 2)
    assert not (tmp_path / "m").exists() or list_versions(tmp_path / "m") == []


# -- restore ------------------------------------------------------------------------------


async def test_restore_base_and_two_deltas_from_2_shards_into_3(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    source, deleted = build_chain(tmp_path, rng)
    chain = latest_chain(tmp_path / "ctr")
    assert [(c.version, c.kind, c.parent) for c in chain] == [(1, "base", None), (2, "delta", 1), (3, "delta", 2)]

    restored = restore_shards(chain, 3)
    assert restored.version == 3
    assert restored.offsets == {"clicks": {0: 31, 1: 40}, "clicks.more": {0: 5}}
    assert [s.spec for s in restored.shards] == [ShardSpec(i, 3) for i in range(3)]
    for s in restored.shards:
        for t in s.tables.values():
            assert (t.version, t.last_snapshot) == (4, 3)
            keys = t.index.row_keys[np.flatnonzero(t.index.row_live[: t.index.num_rows])]
            assert keys.size == len(t) > 0
            assert (shard_of(keys, 3) == s.spec.shard_id).all()  # re-hashed
    for cfg in TABLES:
        src = rows_of(source, cfg.name)
        assert_same_rows(rows_of(restored.shards, cfg.name), src)
        assert not np.isin(deleted, src["keys"]).any()

    # The same weights through the client, for every key ever used (the
    # deleted ones read their initial value on both sides).
    all_keys = np.concatenate([rows_of(source, "lr")["keys"], deleted])
    before, after = PSClient.local(source), PSClient.local(restored.shards)
    for cfg in TABLES:
        np.testing.assert_array_equal(await after.pull(cfg.name, all_keys), await before.pull(cfg.name, all_keys))

    # One shard of the three alone, and everything into a single shard.
    only = restore_shards(chain, 3, shard_ids=[1])
    assert_same_rows(rows_of(only.shards, "fm_v"), rows_of([restored.shards[1]], "fm_v"))
    single = restore_shards(chain, 1)
    assert_same_rows(rows_of(single.shards, "lr"), rows_of(source, "lr"))

    # Training goes on in version 4, and the next delta follows the restore.
    keys = rows_of(source, "lr")["keys"][:10]
    push(restored.shards, keys, rng, 5_000)
    delta = {s.spec.shard_id: [s.tables["lr"].snapshot(3)] for s in restored.shards}
    assert sorted(k for v in delta.values() for s in v for k in s.keys.tolist()) == sorted(keys.tolist())


def test_restore_upto_an_older_version(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    shards = make_shards(2)
    push(shards, np.arange(1, 400, dtype=np.uint64), rng, 1)
    write_version(tmp_path, "ctr", 1, None, cut(shards, None), {"t": {0: 1}}, {}, 2)
    at_1 = rows_of(shards, "lr")
    delete(shards, np.arange(1, 100, dtype=np.uint64))
    write_version(tmp_path, "ctr", 2, 1, cut(shards, 1), {"t": {0: 2}}, {}, 2)
    chain = latest_chain(tmp_path / "ctr", upto=1)
    assert [c.version for c in chain] == [1]
    restored = restore_shards(chain, 2)
    assert restored.offsets == {"t": {0: 1}}
    assert_same_rows(rows_of(restored.shards, "lr"), at_1)
    with pytest.raises(ExportNotFoundError):
        latest_chain(tmp_path / "ctr", upto=0)
    with pytest.raises(ExportNotFoundError):
        latest_chain(tmp_path / "nothing-here")


# -- damage and atomicity -------------------------------------------------------------------


def test_a_flipped_byte_names_the_file_and_both_checksums(tmp_path: Path) -> None:
    build_chain(tmp_path, np.random.default_rng(6))
    vdir = tmp_path / "ctr" / "0000000003"
    entry = next(f for f in read_manifest(vdir).files if f.name == "shard-1.lr.npz")
    path = vdir / entry.name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)
    actual = hashlib.sha256(raw).hexdigest()

    for attempt in (
        lambda: load_version(vdir),
        lambda: verify_version(vdir),
        lambda: restore_shards(latest_chain(tmp_path / "ctr"), 3),
        lambda: latest_chain(tmp_path / "ctr", verify=True),
    ):
        with pytest.raises(ExportCorruptError) as info:
            attempt()
        err = info.value
        assert (err.file, err.expected, err.actual) == (str(path), entry.sha256, actual)
        assert str(path) in err.detail and entry.sha256 in err.detail and actual in err.detail
        assert (err.code, err.status) == ("export_corrupt", 500)
    # Sizes still match, so a listing without hashing accepts it; with
    # hashing and fallback the newest sound chain is used.
    assert [c.version for c in latest_chain(tmp_path / "ctr")] == [1, 2, 3]
    assert [c.version for c in latest_chain(tmp_path / "ctr", verify=True, fallback=True)] == [1, 2]


def test_missing_and_truncated_files_are_corrupt(tmp_path: Path) -> None:
    build_chain(tmp_path, np.random.default_rng(7))
    v2, v3 = tmp_path / "ctr" / "0000000002", tmp_path / "ctr" / "0000000003"
    (v3 / "shard-0.fm_v.npz").unlink()
    with pytest.raises(ExportCorruptError, match="shard-0.fm_v.npz: missing") as info:
        latest_chain(tmp_path / "ctr")
    assert info.value.actual == "missing"
    with open(v2 / "shard-1.lr.npz", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ExportCorruptError, match="100 bytes") as info:
        load_version(v2, verify=False)
    assert info.value.actual == "100 bytes"
    # Fallback skips 3 (missing file) and 2 (truncated): only the base is sound.
    assert [c.version for c in latest_chain(tmp_path / "ctr", fallback=True)] == [1]
    # A manifest that is not one is corrupt too, and names itself.
    (v2 / "manifest.json").write_text('{"format": "ctrps-export", "format_version": 1}')
    with pytest.raises(ExportCorruptError, match="manifest.json: not a valid export manifest"):
        read_manifest(v2)


def test_partial_and_temporary_versions_are_invisible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_chain(tmp_path, np.random.default_rng(8))
    mdir = tmp_path / "ctr"
    # A copy of version 3 under a temporary name, manifest and all, and stray entries.
    tmp = mdir / ".tmp-0000000004-deadbeef"
    tmp.mkdir()
    for p in (mdir / "0000000003").iterdir():
        (tmp / p.name).write_bytes(p.read_bytes())
    (mdir / "notes.txt").write_text("not a version")
    (mdir / "0000000009.partial").mkdir()
    assert [i.version for i in list_versions(mdir)] == [1, 2, 3]
    assert latest_chain(mdir)[-1].version == 3

    # A writer that fails half-way leaves nothing behind.
    real = export._write_npz
    calls = 0

    def failing(path: Path, arrays: Any) -> tuple[int, str]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("disk full")
        return real(path, arrays)

    monkeypatch.setattr(export, "_write_npz", failing)
    shards = make_shards(2)
    push(shards, np.arange(10, dtype=np.uint64), np.random.default_rng(0), 1)
    snaps = cut(shards, None)  # 4 files: the third one fails
    with pytest.raises(OSError, match="disk full"):
        write_version(tmp_path, "other", 1, None, snaps, {}, {}, 2)
    assert calls == 3
    assert os.listdir(tmp_path / "other") == []

    # A numbered directory without a manifest: listed by nobody, and fatal to
    # the newest chain unless the caller asks for fallback.
    (mdir / "0000000004").mkdir()
    assert [i.version for i in list_versions(mdir)] == [1, 2, 3]
    with pytest.raises(ExportCorruptError, match="0000000004/manifest.json: missing"):
        latest_chain(mdir)
    assert latest_chain(mdir, fallback=True)[-1].version == 3
    # A delta whose parent is gone breaks its chain the same way.
    os.rmdir(mdir / "0000000004")
    os.rename(mdir / "0000000002", mdir / ".gone")
    with pytest.raises(ExportCorruptError, match="parent 2, which is missing"):
        latest_chain(mdir)
    assert [c.version for c in latest_chain(mdir, fallback=True)] == [1]


# -- compaction and retention ----------------------------------------------------------------


def test_compaction_folds_the_chain_into_a_base_of_the_same_version(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    source, _ = build_chain(tmp_path, rng)
    mdir = tmp_path / "ctr"
    at_3 = {cfg.name: rows_of(source, cfg.name) for cfg in TABLES}
    push(source, rows_of(source, "lr")["keys"][:200], rng, 4_000)
    delete(source, rows_of(source, "lr")["keys"][-30:])
    write_version(tmp_path, "ctr", 4, 3, cut(source, 3), {"clicks": {0: 50, 1: 60}}, MODEL_CONFIG, 2)
    old_3 = read_manifest(mdir / "0000000003")

    info = compact(mdir, 3)
    m = info.manifest
    assert (info.version, info.kind, info.parent, info.path) == (3, "base", None, mdir / "0000000003")
    assert (m.offsets, m.model_config, m.created_at) == (old_3.offsets, old_3.model_config, old_3.created_at)
    assert m.compacted_from == (1, 2, 3) and m.deleted() == 0
    assert sorted(p.name for p in mdir.iterdir()) == ["0000000001", "0000000002", "0000000003", "0000000004"]
    assert latest_chain(mdir, upto=3) == [info]
    folded = restore_shards([info], 2)
    for cfg in TABLES:
        assert_same_rows(rows_of(folded.shards, cfg.name), at_3[cfg.name])
    # The delta after it applies to the new base as it did to the chain.
    chain = latest_chain(mdir, verify=True)
    assert [c.version for c in chain] == [3, 4]
    restored = restore_shards(chain, 3)
    for cfg in TABLES:
        assert_same_rows(rows_of(restored.shards, cfg.name), rows_of(source, cfg.name))
    assert compact(mdir, 3) == latest_chain(mdir, upto=3)[0]  # already a base
    with pytest.raises(ExportNotFoundError):
        compact(mdir, 7)


def test_prune_keeps_the_newest_bases_and_what_follows(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    shards = make_shards(1)
    last: int | None = None
    for v in range(1, 8):  # bases at 1, 4, 6
        push(shards, rng.choice(10_000, size=20).astype(np.uint64), rng, v)
        base = v in (1, 4, 6)
        write_version(tmp_path, "ctr", v, None if base else last, cut(shards, None if base else last), {}, {}, 1)
        last = v
    mdir = tmp_path / "ctr"
    stale, fresh = mdir / ".tmp-0000000008-00000000", mdir / ".old-0000000003-11111111"
    stale.mkdir()
    fresh.mkdir()
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))

    assert prune(mdir, keep_bases=2) == [1, 2, 3]
    assert [i.version for i in list_versions(mdir)] == [4, 5, 6, 7]
    assert not stale.exists() and fresh.exists()
    assert prune(mdir, keep_bases=2) == []
    assert [c.version for c in latest_chain(mdir, upto=5)] == [4, 5]
    assert prune(mdir, keep_bases=3) == []  # only two bases left: nothing goes
    assert prune(mdir, keep_bases=1) == [4, 5]
    assert [c.version for c in latest_chain(mdir)] == [6, 7]
    assert not any(p.name.startswith(".del-") for p in mdir.iterdir())
    with pytest.raises(ValueError):
        prune(mdir, keep_bases=0)


# -- the documentation's reader --------------------------------------------------------------


def test_the_documented_numpy_reader_reads_the_chain(tmp_path: Path) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "export-format.md").read_text()
    match = re.search(r"<!-- example: read-chain -->\n```python\n(.*?)```", doc, re.S)
    assert match, "the example block is missing from docs/export-format.md"
    source, deleted = build_chain(tmp_path, np.random.default_rng(11))
    scope: dict[str, Any] = {"model_dir": str(tmp_path / "ctr")}
    exec(compile(match.group(1), "export-format.md", "exec"), scope)
    weights = scope["weights"]
    client_keys = {cfg.name: rows_of(source, cfg.name)["keys"] for cfg in TABLES}
    for cfg in TABLES:
        keys = client_keys[cfg.name]
        assert sorted(weights[cfg.name]) == keys.tolist()
        got = np.stack([weights[cfg.name][k] for k in keys.tolist()])
        want = np.concatenate([s.tables[cfg.name].pull(keys[shard_of(keys, 2) == s.spec.shard_id]) for s in source])
        order = np.concatenate([np.flatnonzero(shard_of(keys, 2) == i) for i in range(2)])
        np.testing.assert_allclose(got[order], want, rtol=1e-6, atol=0)
        assert not set(deleted.tolist()) & set(weights[cfg.name])


def _modes(version_dir: Path) -> tuple[int, set[int]]:
    """The mode of a version's directory and the modes of its files."""
    return version_dir.stat().st_mode & 0o7777, {p.stat().st_mode & 0o7777 for p in version_dir.iterdir()}


def test_exports_are_this_users_only_unless_another_mode_is_asked(tmp_path: Path) -> None:
    """Files 0600 and directories 0700 whatever the umask lets through; an
    asked mode is kept exactly, compaction included."""
    shards = make_shards(2)
    push(shards, np.arange(1, 200, dtype=np.uint64), np.random.default_rng(3), 1_000)
    previous = os.umask(0o000)  # the widest: nothing is taken away
    try:
        path = write_version(tmp_path / "private", "ctr", 1, None, cut(shards, None), {}, MODEL_CONFIG, 2)
        assert _modes(path) == (0o700, {0o600})
        assert (path.parent.stat().st_mode & 0o777) == 0o700  # the model's directory, made by the writer
        os.umask(0o077)  # the narrowest: an asked 0640 still gets its group bits
        shared = write_version(
            tmp_path / "shared", "ctr", 2, None, cut(shards, None), {}, MODEL_CONFIG, 2, file_mode=0o640
        )
        assert _modes(shared) == (0o750, {0o640})
        push(shards, np.arange(1, 50, dtype=np.uint64), np.random.default_rng(4), 2_000)
        write_version(tmp_path / "shared", "ctr", 3, 2, cut(shards, 2), {}, MODEL_CONFIG, 2, file_mode=0o640)
        folded = compact(tmp_path / "shared" / "ctr", 3, file_mode=0o640)
        assert _modes(folded.path) == (0o750, {0o640})
    finally:
        os.umask(previous)
    assert export.dir_mode(0o644) == 0o755 and export.dir_mode(0o600) == 0o700
