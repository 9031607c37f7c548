"""Incremental model exports: write, list, verify, load (restore: `restore`;
compaction and retention: `retention`).

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

Writing goes through an `ExportStore` (`ps_core.checkpoint.exportstore`):
`write_version` is `write_version_to` a local directory's; `store_versions`
and `store_manifest` list and read any store's (an ``s3://`` bucket too).
The other readers here (chains, files, restore) still take local paths.

Everything here is synchronous file work: the cut itself (`SparseTable.snapshot`)
is the pause; callers run these functions in a thread after it.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format

from ..errors import ExportCorruptError, ExportNotFoundError
from ..store.snapshot import SnapshotKind, TableSnapshot
from ..store.table_config import TableConfig
from .exportstore import (
    BinaryWriter,
    ExportStore,
    LocalExportStore,
    LocalUpload,
    VersionUpload,
    dir_mode,
    fsync_dir,
    local_version_dirs,
)
from .manifest import (
    MANIFEST_NAME,
    ExportManifest,
    ManifestFile,
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
    "write_version",
    "write_version_to",
    "list_versions",
    "version_dirs",
    "read_manifest",
    "store_manifest",
    "store_versions",
    "verify_version",
    "iter_version",
    "load_version",
    "latest_chain",
    "serves_weights",
    "DEFAULT_FILE_MODE",
    "dir_mode",
    "manifest_snapshots",
    "serving_manifest",
    "write_tree",
    "fsync_dir",
    "version_info",
    "HIDDEN_PREFIXES",
]

HIDDEN_PREFIXES = (".tmp-", ".old-", ".del-")
_CHUNK = 1 << 20

DEFAULT_FILE_MODE = 0o600
"""Mode of export files: this user only (their directories: 0700)."""


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


# -- writing -----------------------------------------------------------------------


class _HashingWriter:
    """A write-only, non-seekable stream that hashes what passes through.

    Non-seekable on purpose: `zipfile` then streams each member with a data
    descriptor after it instead of seeking back to patch its header, so every
    byte is written (and hashed) once, in order.
    """

    def __init__(self, raw: BinaryWriter) -> None:
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


def _write_npz(dest: Path | BinaryWriter, arrays: Mapping[str, npt.NDArray[Any]]) -> tuple[int, str]:
    """Write arrays as an uncompressed .npz (what ``np.savez`` writes) to a new
    file, fsynced, or to a store's stream (`VersionUpload.open`, left open:
    closing it is what makes it durable).

    Returns the size and hex SHA-256, computed while writing.
    """
    if isinstance(dest, Path):
        with open(dest, "xb") as f:
            result = _write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        return result
    out = _HashingWriter(dest)
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
    dest.flush()
    return out.size, out.sha256.hexdigest()


def _write_files(
    upload: VersionUpload, manifest_fields: dict[str, Any], snapshots: Mapping[int, Sequence[TableSnapshot]]
) -> ExportManifest:
    """A version's data and serving files, each through `upload`; returns its
    manifest (not written: the caller commits or seals with it)."""
    precision = manifest_fields.get("serving_precision", "f32")
    files: list[ManifestFile] = []
    serving: list[ManifestFile] = []
    tables: dict[str, TableConfig] = {}
    for shard in sorted(snapshots):
        for snap in snapshots[shard]:
            name, weights = shard_file_name(shard, snap.table), serving_file_name(shard, snap.table)
            for target, arrays, entries in (
                (name, snap.arrays(), files),
                (weights, serving_arrays(snap, precision), serving),
            ):
                with upload.open(target) as raw:
                    size, digest = _write_npz(raw, arrays)
                entries.append(ManifestFile(target, shard, snap.table, snap.rows, int(snap.deleted.size), size, digest))
            tables[snap.table] = snap.config
    return ExportManifest(
        tables=dict(sorted(tables.items())), files=tuple(files), serving_files=tuple(serving), **manifest_fields
    )


def write_tree(
    parent_dir: Path,
    manifest_fields: dict[str, Any],
    snapshots: Mapping[int, Sequence[TableSnapshot]],
    file_mode: int = DEFAULT_FILE_MODE,
) -> tuple[Path, ExportManifest]:
    """Write a version into a new hidden directory of `parent_dir` (data files,
    then the manifest, everything fsynced); returns it and its manifest. The
    directory is 0700 while it is written; then its files get `file_mode` and
    it gets `dir_mode(file_mode)`, exactly, whatever the umask."""
    upload = LocalUpload(parent_dir, int(manifest_fields["version"]), file_mode)
    try:
        manifest = _write_files(upload, manifest_fields, snapshots)
    except BaseException:
        upload.abort()
        raise
    return upload.seal(manifest.to_json()), manifest


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
    return Path(
        write_version_to(
            LocalExportStore(root),
            model,
            version,
            parent,
            snapshots,
            offsets,
            model_config,
            num_shards,
            stream=stream,
            serving_precision=serving_precision,
            file_mode=file_mode,
        )
    )


def write_version_to(
    store: ExportStore,
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
) -> str:
    """`write_version` into any `ExportStore` (a local directory, an S3 bucket):
    the files, then the manifest, which makes the version visible; returns its
    location. `FileExistsError` if the version exists or appears meanwhile."""
    kind = _check_snapshots(version, parent, snapshots, num_shards)
    upload = store.begin(check_model_name(model), version, file_mode=file_mode)
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
    try:
        manifest = _write_files(upload, fields, snapshots)
    except BaseException:
        upload.abort()
        raise
    return upload.commit(manifest.to_json())


# -- reading ------------------------------------------------------------------------


def read_manifest(version_dir: Path) -> ExportManifest:
    """A version's manifest; `ExportCorruptError` if missing or malformed, or if
    it names another version than its directory."""
    path = Path(version_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    return _checked_manifest(raw, str(path), parse_version_dir(Path(version_dir).name))


def store_manifest(store: ExportStore, model: str, version: int) -> ExportManifest:
    """`read_manifest` of a version in an `ExportStore`."""
    try:
        raw: bytes | None = store.read_bytes(model, version, MANIFEST_NAME)
    except FileNotFoundError:
        raw = None
    return _checked_manifest(raw, store.location(model, version, MANIFEST_NAME), version)


def _checked_manifest(raw: bytes | None, where: str, expect: int | None) -> ExportManifest:
    """The manifest in `raw` (None: missing), read from `where`, which must be
    of version `expect` (when not None)."""
    if raw is None:
        raise ExportCorruptError(f"{where}: missing", file=where, expected="a manifest", actual="missing")
    manifest = ExportManifest.from_json(raw, where)
    if expect is not None and manifest.version != expect:
        raise ExportCorruptError(
            f"{where}: names version {manifest.version}, its directory {expect}",
            file=where,
            expected=str(expect),
            actual=str(manifest.version),
        )
    return manifest


def version_dirs(model_dir: Path) -> dict[int, Path]:
    """Version number → directory for every visible version name (hidden
    temporaries and anything not a number are skipped); no manifest is read,
    so a damaged version is listed too (`list_versions` skips those)."""
    return local_version_dirs(Path(model_dir))


def version_info(path: Path, manifest: ExportManifest) -> VersionInfo:
    return VersionInfo(manifest.version, manifest.kind, manifest.parent, manifest.created_at, path, manifest)


def list_versions(model_dir: Path) -> list[VersionInfo]:
    """The versions of a model, oldest first.

    Hidden entries (writes in progress, compaction and pruning leftovers) are
    never listed; neither are numbered directories whose manifest is missing
    or unreadable (`latest_chain` reports those). Files are not checked.
    """
    dirs = version_dirs(Path(model_dir))
    return [version_info(dirs[v], m) for v, m in _readable(dirs, lambda v: read_manifest(dirs[v]))]


def store_versions(store: ExportStore, model: str) -> list[tuple[str, ExportManifest]]:
    """`list_versions` of a model in an `ExportStore`: each visible version's
    location and manifest, oldest first; unreadable manifests are skipped."""
    where = store.versions(model)
    return [(where[v], m) for v, m in _readable(where, lambda v: store_manifest(store, model, v))]


def _readable(
    versions: Mapping[int, object], read: Callable[[int], ExportManifest]
) -> Iterator[tuple[int, ExportManifest]]:
    """Each version's manifest, oldest first, skipping those that do not read."""
    for v in sorted(versions):
        try:
            yield v, read(v)
        except ExportCorruptError:
            continue


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
    return manifest_snapshots(vdir, read_manifest(vdir), verify)


def manifest_snapshots(
    vdir: Path, manifest: ExportManifest, verify: bool, serving: bool = False
) -> Iterator[tuple[int, TableSnapshot]]:
    for entry in manifest.serving_files if serving else manifest.files:
        yield entry.shard, _read_snapshot(vdir, manifest, entry, verify, serving)


def serves_weights(manifest: ExportManifest) -> bool:
    """Whether a version has serving files for every data file
    (`ps_core.checkpoint.serving_files`); versions written before them have none."""
    return len(manifest.serving_files) == len(manifest.files)


def serving_manifest(manifest: ExportManifest) -> ExportManifest:
    """The manifest as a replica of weights applies it: its tables' `serving_config`."""
    return replace(manifest, tables={name: serving_config(c) for name, c in manifest.tables.items()})


def load_version(version_dir: Path, verify: bool = True, *, serving: bool = False) -> LoadedVersion:
    """A whole version in memory; `ExportCorruptError` names the first bad file.

    With `serving`, its serving files, as the snapshots of `serving_config`
    tables (and the manifest's tables are those): what a replica applies."""
    manifest = read_manifest(Path(version_dir))
    snapshots: dict[int, list[TableSnapshot]] = {i: [] for i in range(manifest.num_shards)}
    for shard, snap in manifest_snapshots(Path(version_dir), manifest, verify, serving):
        snapshots.setdefault(shard, []).append(snap)
    return LoadedVersion(serving_manifest(manifest) if serving else manifest, snapshots)


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
        chain.append(version_info(path, manifest))
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
