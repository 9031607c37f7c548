"""Incremental model exports: write, list, verify, load, restore, compact, prune.

An export version is a directory ``<root>/<model>/<version>/`` (the version
zero-padded to 10 digits) holding ``manifest.json`` and one uncompressed
``.npz`` per shard and table, ``shard-<i>.<table>.npz`` (layout, fields and a
numpy-only reader in docs/export-format.md). A base holds every row; a delta
the rows changed since its parent and the keys deleted since then. A chain is
a base and the deltas that follow it, each the parent of the next; restoring
it into any number of shards re-hashes the keys (`shard_of`).

A version appears by one atomic rename of a fully written, fsynced hidden
directory (``.tmp-<version>-<random>``); readers skip hidden names, so a
partial export is never visible. Files are checked against the manifest's
sizes and SHA-256s; a mismatch is an `ExportCorruptError` naming the file.

Files are written with mode 0600 and version directories 0700 unless the
writer asks for another `file_mode` (directories get an ``x`` wherever the
files get an ``r``): a version holds the whole model, its optimizer state and
offsets, which no other local user should read by default.

Everything here is synchronous file work: the cut itself (`SparseTable.snapshot`)
is the pause; callers run these functions in a thread after it.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format

from ..errors import ExportCorruptError, ExportNotFoundError, InvalidValuesError, TableConflictError
from ..hashing import shard_of
from ..shard import Shard, ShardSpec
from ..store.snapshot import SnapshotKind, TableSnapshot
from ..store.table_config import TableConfig
from .manifest import (
    MANIFEST_NAME,
    ExportManifest,
    ManifestFile,
    Offsets,
    check_model_name,
    parse_version_dir,
    serving_file_name,
    shard_file_name,
    version_dir_name,
)
from .serving_files import INT8_ARRAYS, SERVING_ARRAYS, serving_arrays, serving_config, serving_snapshot
from .stream import StreamIdentity

__all__ = [
    "VersionInfo",
    "LoadedVersion",
    "RestoreResult",
    "write_version",
    "list_versions",
    "version_dirs",
    "read_manifest",
    "verify_version",
    "iter_version",
    "load_version",
    "latest_chain",
    "restore_into",
    "serves_weights",
    "restore_shards",
    "apply_version",
    "compact",
    "prune",
    "DEFAULT_FILE_MODE",
    "dir_mode",
]

_HIDDEN_PREFIXES = (".tmp-", ".old-", ".del-")
_CHUNK = 1 << 20

DEFAULT_FILE_MODE = 0o600
"""Mode of export files: this user only (their directories: 0700)."""


def dir_mode(file_mode: int) -> int:
    """The mode of directories holding files of `file_mode`: ``x`` wherever ``r``."""
    return file_mode | ((file_mode & 0o444) >> 2)


def _make_dir(path: Path, file_mode: int, *, exist_ok: bool = False) -> None:
    """Make `path` (and its parents) of exactly `dir_mode(file_mode)`, whatever
    the umask; an existing one keeps its mode."""
    mode = dir_mode(file_mode)
    try:
        path.mkdir(mode=mode, parents=True)
    except FileExistsError:
        if not exist_ok:
            raise
        return
    os.chmod(path, mode)


@dataclass(frozen=True)
class VersionInfo:
    """A complete version directory, as listed."""

    version: int
    """The version number."""
    kind: SnapshotKind
    """``"base"`` or ``"delta"``."""
    parent: int | None
    """The version a delta applies on top of; None for a base."""
    created_at: datetime
    """When the cut was taken (UTC)."""
    path: Path
    """The version directory."""
    manifest: ExportManifest
    """Its manifest."""

    def to_json(self) -> dict[str, Any]:
        """As an export listing shows it (`ExportList`'s `VersionEntry`)."""
        return {
            "version": self.version,
            "kind": self.kind,
            "parent": self.parent,
            "created_at": self.created_at,
            "rows": self.manifest.rows(),
            "bytes": self.manifest.nbytes(),
        }


@dataclass(frozen=True)
class LoadedVersion:
    """A version read into memory."""

    manifest: ExportManifest
    """Its manifest."""
    snapshots: dict[int, list[TableSnapshot]]
    """Each writing shard's table snapshots, by shard number."""


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


# -- writing -----------------------------------------------------------------------


class _HashingWriter:
    """A write-only, non-seekable stream that hashes what passes through.

    Non-seekable on purpose: `zipfile` then streams each member with a data
    descriptor after it instead of seeking back to patch its header, so every
    byte is written (and hashed) once, in order.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, b: bytes | bytearray | memoryview) -> int:
        self.sha256.update(b)
        self._raw.write(b)
        n = memoryview(b).nbytes
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        """Nothing: the caller owns the file (zipfile never closes a passed file)."""


def _write_npz(path: Path, arrays: Mapping[str, npt.NDArray[Any]]) -> tuple[int, str]:
    """Write arrays as an uncompressed .npz (what ``np.savez`` writes), fsynced.

    Returns the size and hex SHA-256, computed while writing.
    """
    with open(path, "xb") as raw:
        out = _HashingWriter(raw)
        with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                a = np.ascontiguousarray(arr)
                # force_zip64 as np.savez does: members may pass 4 GiB.
                with zf.open(name + ".npy", "w", force_zip64=True) as member:
                    # What np.save writes (format 1.0 header, then the raw
                    # C-order bytes), minus its copy of the data through a
                    # buffered iterator: slices of one memoryview go straight
                    # through zipfile's CRC, the SHA-256 and the write, each
                    # slice small enough to stay in cache across the three.
                    npy_format.write_array_header_1_0(member, npy_format.header_data_from_array_1_0(a))
                    raw_bytes = a.reshape(-1).view(np.uint8).data
                    for i in range(0, raw_bytes.nbytes, _CHUNK):
                        member.write(raw_bytes[i : i + _CHUNK])
        raw.flush()
        os.fsync(raw.fileno())
    return out.size, out.sha256.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tree(
    parent_dir: Path,
    manifest_fields: dict[str, Any],
    snapshots: Mapping[int, Sequence[TableSnapshot]],
    file_mode: int = DEFAULT_FILE_MODE,
) -> tuple[Path, ExportManifest]:
    """Write a version into a new hidden directory of `parent_dir` (data files,
    then the manifest, everything fsynced); returns it and its manifest. The
    directory is 0700 while it is written; then its files get `file_mode` and
    it gets `dir_mode(file_mode)`, exactly, whatever the umask."""
    version = int(manifest_fields["version"])
    precision = manifest_fields.get("serving_precision", "f32")
    tmp = parent_dir / f".tmp-{version_dir_name(version)}-{secrets.token_hex(4)}"
    _make_dir(tmp, DEFAULT_FILE_MODE)
    try:
        files: list[ManifestFile] = []
        serving: list[ManifestFile] = []
        tables: dict[str, TableConfig] = {}
        for shard in sorted(snapshots):
            for snap in snapshots[shard]:
                name, weights = shard_file_name(shard, snap.table), serving_file_name(shard, snap.table)
                size, digest = _write_npz(tmp / name, snap.arrays())
                files.append(ManifestFile(name, shard, snap.table, snap.rows, int(snap.deleted.size), size, digest))
                size, digest = _write_npz(tmp / weights, serving_arrays(snap, precision))
                serving.append(
                    ManifestFile(weights, shard, snap.table, snap.rows, int(snap.deleted.size), size, digest)
                )
                tables[snap.table] = snap.config
        manifest = ExportManifest(
            tables=dict(sorted(tables.items())), files=tuple(files), serving_files=tuple(serving), **manifest_fields
        )
        with open(tmp / MANIFEST_NAME, "xb") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        for written in tmp.iterdir():
            os.chmod(written, file_mode)
        os.chmod(tmp, dir_mode(file_mode))
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, manifest


def _check_snapshots(
    version: int,
    parent: int | None,
    snapshots: Mapping[int, Sequence[TableSnapshot]],
    num_shards: int,
) -> SnapshotKind:
    """The version's kind; ValueError when the snapshots do not make one cut."""
    kind: SnapshotKind = "base" if parent is None else "delta"
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if set(snapshots) != set(range(num_shards)):
        raise ValueError(f"a cut needs snapshots of shards 0..{num_shards - 1}, got {sorted(snapshots)}")
    configs: dict[str, TableConfig] = {}
    for shard, snaps in snapshots.items():
        names = [s.table for s in snaps]
        if len(set(names)) != len(names):
            raise ValueError(f"shard {shard} has several snapshots of one table: {names}")
        for s in snaps:
            if (s.version, s.kind, s.parent) != (version, kind, parent):
                raise ValueError(
                    f"shard {shard} table {s.table}: a {s.kind} of version {s.version} "
                    f"(parent {s.parent}) in a {kind} of version {version} (parent {parent})"
                )
            if configs.setdefault(s.table, s.config) != s.config:
                raise ValueError(f"table {s.table} is declared differently on different shards")
    return kind


def write_version(
    root: Path,
    model: str,
    version: int,
    parent: int | None,
    snapshots: Mapping[int, Sequence[TableSnapshot]],
    offsets: Mapping[str, Mapping[int, int]],
    model_config: Mapping[str, Any],
    num_shards: int,
    *,
    stream: StreamIdentity | None = None,
    serving_precision: str = "f32",
    file_mode: int = DEFAULT_FILE_MODE,
) -> Path:
    """Write one export version and make it visible atomically; returns its directory.

    `snapshots` maps every shard number in ``range(num_shards)`` to its
    tables' snapshots of this cut (all of `version`; deltas of `parent`, or
    bases when `parent` is None). `offsets` are the next offsets to consume per
    topic and partition, read from `stream` (recorded in the manifest, so a
    restore can tell which Kafka they belong to); `model_config` is stored as given (JSON). The files
    go to a hidden temporary directory, are fsynced, and the directory is
    renamed to ``<root>/<model>/<version>`` (then the model directory is
    fsynced). `FileExistsError` if the version exists. Synchronous: run it in
    a thread. Its serving files hold the weights in `serving_precision`
    (`ps_core.checkpoint.serving_files`). Its files get `file_mode`, its directory
    (and the model's, when this makes it) `dir_mode(file_mode)`.
    """
    kind = _check_snapshots(version, parent, snapshots, num_shards)
    mdir = Path(root) / check_model_name(model)
    _make_dir(mdir, file_mode, exist_ok=True)
    final = mdir / version_dir_name(version)
    if final.exists():
        raise FileExistsError(f"export version {version} exists: {final}")
    fields: dict[str, Any] = {
        "model": model,
        "version": version,
        "parent": parent,
        "kind": kind,
        "created_at": datetime.now(UTC),
        "model_config": dict(model_config),
        "num_shards": num_shards,
        "offsets": {str(t): {int(p): int(o) for p, o in parts.items()} for t, parts in offsets.items()},
        "stream": stream,
        "serving_precision": serving_precision,
    }
    tmp, _ = _write_tree(mdir, fields, snapshots, file_mode)
    try:
        # rename(2) would replace an empty directory created meanwhile; the
        # check above makes that a race between two writers of one version.
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(mdir)
    return final


# -- reading ------------------------------------------------------------------------


def read_manifest(version_dir: Path) -> ExportManifest:
    """A version's manifest; `ExportCorruptError` if missing or malformed, or if
    it names another version than its directory."""
    path = Path(version_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ExportCorruptError(f"{path}: missing", file=str(path), expected="a manifest", actual="missing") from None
    manifest = ExportManifest.from_json(raw, str(path))
    expect = parse_version_dir(Path(version_dir).name)
    if expect is not None and manifest.version != expect:
        raise ExportCorruptError(
            f"{path}: names version {manifest.version}, its directory {expect}",
            file=str(path),
            expected=str(expect),
            actual=str(manifest.version),
        )
    return manifest


def version_dirs(model_dir: Path) -> dict[int, Path]:
    """Version number → directory for every visible version name (hidden
    temporaries and anything not a number are skipped); no manifest is read,
    so a damaged version is listed too (`list_versions` skips those)."""
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(model_dir))
    except FileNotFoundError:
        return out
    for e in entries:
        v = parse_version_dir(e.name)
        if v is not None and e.is_dir():
            # Two spellings of one number (e.g. "12" and "0000000012"): keep
            # the canonical one.
            if v not in out or e.name == version_dir_name(v):
                out[v] = Path(e.path)
    return out


def _info(path: Path, manifest: ExportManifest) -> VersionInfo:
    return VersionInfo(manifest.version, manifest.kind, manifest.parent, manifest.created_at, path, manifest)


def list_versions(model_dir: Path) -> list[VersionInfo]:
    """The versions of a model, oldest first.

    Hidden entries (writes in progress, compaction and pruning leftovers) are
    never listed; neither are numbered directories whose manifest is missing
    or unreadable (`latest_chain` reports those). Files are not checked.
    """
    out: list[VersionInfo] = []
    for _, path in sorted(version_dirs(Path(model_dir)).items()):
        try:
            out.append(_info(path, read_manifest(path)))
        except ExportCorruptError:
            continue
    return out


def _check_file(version_dir: Path, entry: ManifestFile, verify: bool) -> bytes | None:
    """Check a file against its entry: present with the right size, and, when
    `verify`, the right SHA-256 (then its bytes are returned, read once)."""
    path = version_dir / entry.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ExportCorruptError(
            f"{path}: missing (manifest expects {entry.bytes} bytes, sha256 {entry.sha256})",
            file=str(path),
            expected=entry.sha256,
            actual="missing",
        ) from None
    if size != entry.bytes:
        raise ExportCorruptError(
            f"{path}: {size} bytes, manifest expects {entry.bytes} (sha256 {entry.sha256})",
            file=str(path),
            expected=f"{entry.bytes} bytes",
            actual=f"{size} bytes",
        )
    if not verify:
        return None
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != entry.sha256:
        raise ExportCorruptError(
            f"{path}: sha256 {digest}, manifest expects {entry.sha256}",
            file=str(path),
            expected=entry.sha256,
            actual=digest,
        )
    return raw


def verify_version(version_dir: Path) -> ExportManifest:
    """Check every file of a version (presence, size, SHA-256); returns the manifest."""
    manifest = read_manifest(version_dir)
    for entry in manifest.files + manifest.serving_files:
        _check_file(Path(version_dir), entry, verify=True)
    return manifest


def _read_snapshot(
    version_dir: Path, manifest: ExportManifest, entry: ManifestFile, verify: bool, serving: bool = False
) -> TableSnapshot:
    """The snapshot a data file holds, or with `serving` a serving file's (as
    the snapshot of its `serving_config` table)."""
    raw = _check_file(version_dir, entry, verify)
    path = version_dir / entry.name
    source: Path | io.BytesIO = path if raw is None else io.BytesIO(raw)
    try:
        with np.load(source, allow_pickle=False) as npz:
            if serving:
                names = INT8_ARRAYS if "codes" in npz.files else SERVING_ARRAYS
                snap = serving_snapshot(manifest, entry.table, {name: npz[name] for name in names})
            else:
                # Format 1 files lack the lifecycle's members: their defaults.
                arrays = {
                    name: npz[name]
                    for name in TableSnapshot.ARRAYS
                    if name in npz or name not in TableSnapshot.OPTIONAL
                }
                snap = TableSnapshot(
                    table=entry.table,
                    config=manifest.tables[entry.table],
                    version=manifest.version,
                    kind=manifest.kind,
                    parent=manifest.parent,
                    **arrays,
                )
    except (ValueError, KeyError, OSError, EOFError, TypeError, AttributeError, zipfile.BadZipFile) as exc:
        # Whatever np.load makes of bytes that are not the .npz the manifest
        # describes (possible without `verify`, or if the writer was wrong).
        raise ExportCorruptError(f"{path}: unreadable: {type(exc).__name__}: {exc}", file=str(path)) from None
    if (snap.rows, int(snap.deleted.size)) != (entry.rows, entry.deleted):
        raise ExportCorruptError(
            f"{path}: {snap.rows} rows and {snap.deleted.size} deletions, manifest says "
            f"{entry.rows} and {entry.deleted}",
            file=str(path),
            expected=f"{entry.rows} rows",
            actual=f"{snap.rows} rows",
        )
    return snap


def iter_version(version_dir: Path, verify: bool = True) -> Iterator[tuple[int, TableSnapshot]]:
    """(shard, snapshot) for each file of a version, one file in memory at a time.

    With `verify`, each file's SHA-256 is checked before it is parsed (the
    parsed bytes are the checked ones); otherwise only its size.
    """
    vdir = Path(version_dir)
    return _iter_snapshots(vdir, read_manifest(vdir), verify)


def _iter_snapshots(
    vdir: Path, manifest: ExportManifest, verify: bool, serving: bool = False
) -> Iterator[tuple[int, TableSnapshot]]:
    for entry in manifest.serving_files if serving else manifest.files:
        yield entry.shard, _read_snapshot(vdir, manifest, entry, verify, serving)


def serves_weights(manifest: ExportManifest) -> bool:
    """Whether a version has serving files for every data file
    (`ps_core.checkpoint.serving_files`); versions written before them have none."""
    return len(manifest.serving_files) == len(manifest.files)


def _serving_tables(manifest: ExportManifest) -> ExportManifest:
    """The manifest as a replica of weights applies it: its tables' `serving_config`."""
    return replace(manifest, tables={name: serving_config(c) for name, c in manifest.tables.items()})


def load_version(version_dir: Path, verify: bool = True, *, serving: bool = False) -> LoadedVersion:
    """A whole version in memory; `ExportCorruptError` names the first bad file.

    With `serving`, its serving files, as the snapshots of `serving_config`
    tables (and the manifest's tables are those): what a replica applies."""
    manifest = read_manifest(Path(version_dir))
    snapshots: dict[int, list[TableSnapshot]] = {i: [] for i in range(manifest.num_shards)}
    for shard, snap in _iter_snapshots(Path(version_dir), manifest, verify, serving):
        snapshots.setdefault(shard, []).append(snap)
    return LoadedVersion(_serving_tables(manifest) if serving else manifest, snapshots)


def _chain_to(version: int, dirs: Mapping[int, Path], verify: bool, serving: bool = False) -> list[VersionInfo]:
    """The chain ending at `version`, base first, every file checked (with
    `serving`, the serving files of versions that have them instead)."""
    chain: list[VersionInfo] = []
    v: int | None = version
    while v is not None:
        path = dirs.get(v)
        if path is None:
            child = chain[-1]
            raise ExportCorruptError(
                f"version {child.version} ({child.path}) has parent {v}, which is missing",
                file=str(child.path.parent / version_dir_name(v)),
                expected=f"version {v}",
                actual="missing",
            )
        manifest = read_manifest(path)
        for entry in manifest.serving_files if serving and serves_weights(manifest) else manifest.files:
            _check_file(path, entry, verify)
        chain.append(_info(path, manifest))
        v = manifest.parent
    chain.reverse()
    return chain


def latest_chain(
    model_dir: Path,
    upto: int | None = None,
    *,
    fallback: bool = False,
    verify: bool = False,
    serving: bool = False,
) -> list[VersionInfo]:
    """The newest complete chain (base first, each delta's parent before it)
    ending at the newest version ``<= upto`` (any version when None).

    Each version's manifest must read and every file be present with its
    size; with `verify`, its SHA-256 too (reading everything). When the
    newest version fails, that is an `ExportCorruptError` unless `fallback`,
    which tries the next older version instead. `ExportNotFoundError` when
    there is no version, or (with fallback) no complete chain. With
    `serving`, the files checked are a replica's: the serving files of the
    versions that have them.
    """
    dirs = version_dirs(Path(model_dir))
    candidates = sorted((v for v in dirs if upto is None or v <= upto), reverse=True)
    if not candidates:
        raise ExportNotFoundError(f"no export version{'' if upto is None else f' <= {upto}'} in {model_dir}")
    failures: list[str] = []
    for v in candidates:
        try:
            return _chain_to(v, dirs, verify, serving)
        except ExportCorruptError as exc:
            if not fallback:
                raise
            failures.append(f"{v}: {exc.detail}")
    raise ExportNotFoundError(f"no complete chain in {model_dir}: " + "; ".join(failures))


# -- restore -------------------------------------------------------------------------


def _check_chain(chain: Sequence[VersionInfo]) -> None:
    if not chain:
        raise ValueError("an empty chain")
    if chain[0].kind != "base":
        raise ValueError(f"a chain starts with a base, not a {chain[0].kind} ({chain[0].path})")
    for prev, cur in zip(chain, chain[1:]):
        if cur.kind != "delta" or cur.parent != prev.version:
            raise ValueError(f"version {cur.version} ({cur.kind}, parent {cur.parent}) does not follow {prev.version}")


def _route(keys: npt.NDArray[np.uint64], shards: Sequence[Shard]) -> list[npt.NDArray[np.intp] | None]:
    """For each target shard, the positions of its keys (None: all of them)."""
    num = shards[0].spec.num_shards
    if num == 1:
        return [None]
    owner = shard_of(keys, num)
    # One comparison per target: cheaper than sorting by owner for the
    # handful of shards a restore builds, and it serves a subset of shards.
    return [np.flatnonzero(owner == s.spec.shard_id) for s in shards]


def _apply(snap: TableSnapshot, shards: Sequence[Shard], source: int, sources: int) -> None:
    """Upsert a snapshot (written by shard `source` of `sources`) into the
    shards owning its rows, then delete its deleted keys (a snapshot never
    has a key in both).

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
    if snap.deleted.size:
        for shard, sel in zip(shards, _route(snap.deleted, shards)):
            table = shard.tables[snap.table]
            table.delete(snap.deleted if sel is None else snap.deleted[sel])
    for shard in shards:
        if same and shard.spec.shard_id == source:
            shard.tables[snap.table].load_counts(scale, snap.sketch_cells, snap.sketch_values)


def restore_into(
    shards: Sequence[Shard], chain: Sequence[VersionInfo], *, verify: bool = True, serving: bool = False
) -> RestoreResult:
    """Load a chain (base, then each delta) into shards of any count.

    The shards must share one `num_shards` and have distinct ids; they may be
    any subset of the cluster (a shard server restores its own slice). Keys
    are re-hashed with `shard_of`; each version's rows are upserted (state and
    metadata as stored), then its deleted keys removed. Tables are declared
    from the manifests (a conflicting declaration is a `TableConflictError`).
    Afterwards every table of the chain has ``version = last + 1`` and the
    next delta is taken relative to the last version.
    """
    _check_chain(chain)
    if not shards:
        raise ValueError("no shards to restore into")
    if len({s.spec.num_shards for s in shards}) != 1 or len({s.spec.shard_id for s in shards}) != len(shards):
        raise ValueError("shards must share num_shards and have distinct ids")
    declared: set[str] = set()
    for info in chain:
        # The chain's own manifests, not re-read ones: were a version swapped
        # by a compaction since the chain was listed, its files no longer
        # match and the load fails instead of mixing a base into the chain.
        tables = _serving_tables(info.manifest).tables if serving else info.manifest.tables
        for config in tables.values():
            for shard in shards:
                shard.declare(config)
            declared.add(config.name)
        for source, snap in _iter_snapshots(info.path, info.manifest, verify, serving):
            _apply(snap, shards, source, info.manifest.num_shards)
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
    for source, snap in snaps:
        _apply(snap, shards, source, m.num_shards)
    for shard in shards:
        for name in m.tables:
            shard.tables[name].mark_exported(m.version)


# -- compaction and retention ----------------------------------------------------------


def compact(
    model_dir: Path, version: int | None = None, *, verify: bool = True, file_mode: int = DEFAULT_FILE_MODE
) -> VersionInfo:
    """Fold the chain ending at `version` (default: the newest) into a base of
    that same version: same offsets, model config and rows as the chain's state.

    The base is written to a hidden directory, then swapped in: the old
    directory is renamed to a hidden name, the new one to the version's name,
    and the old one removed. A reader between the two renames does not see
    the version (if it is the newest, the previous version is the newest);
    deltas after it stay valid, since its content does not change. Run
    compaction and `prune` from one process at a time. A version that is
    already a base is returned as it is. The base's files get `file_mode`.
    """
    mdir = Path(model_dir)
    chain = latest_chain(mdir, version)  # sizes only: the restore checks SHA-256s
    last = chain[-1]
    if version is not None and last.version != version:
        raise ExportNotFoundError(f"no version {version} in {mdir} (newest below: {last.version})")
    if len(chain) == 1:
        return last
    m = last.manifest
    restored = restore_shards(chain, m.num_shards, verify=verify)
    snapshots = {
        s.spec.shard_id: [t.base_copy(last.version) for _, t in sorted(s.tables.items())] for s in restored.shards
    }
    fields: dict[str, Any] = {
        "model": m.model,
        "version": m.version,
        "parent": None,
        "kind": "base",
        "created_at": m.created_at,
        "model_config": m.model_config,
        "num_shards": m.num_shards,
        "offsets": m.offsets,
        "stream": m.stream,
        "compacted_from": tuple(c.version for c in chain),
        "serving_precision": m.serving_precision,
    }
    tmp, manifest = _write_tree(mdir, fields, snapshots, file_mode)
    old = mdir / f".old-{version_dir_name(last.version)}-{secrets.token_hex(4)}"
    os.rename(last.path, old)
    try:
        os.rename(tmp, last.path)
    except BaseException:
        os.rename(old, last.path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(mdir)
    shutil.rmtree(old)
    return _info(last.path, manifest)


def prune(model_dir: Path, keep_bases: int = 2, *, stale_after_s: float = 3600.0) -> list[int]:
    """Remove every version older than the oldest of the newest `keep_bases`
    bases; returns the removed versions.

    Nothing is removed while there are no more than `keep_bases` bases, so
    every kept delta still has its chain. Each removed version is first
    renamed to a hidden name, so no reader sees it half deleted. Hidden
    leftovers (interrupted writes, compactions, prunes) older than
    `stale_after_s` are removed too.
    """
    if keep_bases < 1:
        raise ValueError("keep_bases must be >= 1")
    mdir = Path(model_dir)
    bases = sorted(i.version for i in list_versions(mdir) if i.kind == "base")
    removed: list[int] = []
    if len(bases) > keep_bases:
        oldest_kept = bases[-keep_bases]
        for v, path in sorted(version_dirs(mdir).items()):
            if v >= oldest_kept:
                continue
            doomed = mdir / f".del-{version_dir_name(v)}-{secrets.token_hex(4)}"
            os.rename(path, doomed)
            removed.append(v)
            shutil.rmtree(doomed)
        if removed:
            _fsync_dir(mdir)
    now = time.time()
    for e in list(os.scandir(mdir)):
        if not e.name.startswith(_HIDDEN_PREFIXES):
            continue
        try:
            # A writer may rename its temporary away meanwhile: gone is fine.
            if now - e.stat(follow_symlinks=False).st_mtime <= stale_after_s:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
        except FileNotFoundError:
            pass
    return removed
