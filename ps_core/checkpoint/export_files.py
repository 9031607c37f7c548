"""Incremental model exports: write (list, verify, load: `export_read`,
re-exported here; restore: `restore`; compaction and retention: `retention`).

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
`write_version` is `write_version_to` a local directory's. Reading (listing,
verifying, loading, chains) is `export_read`, re-exported here: its readers
take a local version directory or a store's version (an ``s3://`` bucket too).

Everything here is synchronous file work: the cut itself (`SparseTable.snapshot`)
is the pause; callers run these functions in a thread after it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format

from ..slots import SlotMap
from ..store.snapshot import SnapshotKind, TableSnapshot
from ..store.table_config import TableConfig
from .export_read import (
    LoadedVersion,
    VersionInfo,
    iter_version,
    latest_chain,
    list_versions,
    load_version,
    manifest_snapshots,
    read_manifest,
    serves_weights,
    serving_manifest,
    store_manifest,
    store_versions,
    verify_version,
    version_dirs,
    version_info,
)
from .exportstore import (
    BinaryWriter,
    ExportStore,
    LocalExportStore,
    LocalUpload,
    StoredModel,
    VersionUpload,
    dir_mode,
    fsync_dir,
    store_for,
)
from .manifest import (
    ExportManifest,
    ManifestFile,
    check_model_name,
    serving_file_name,
    shard_file_name,
)
from .serving_files import serving_arrays
from .stream import StreamIdentity

__all__ = [
    # The readers, re-exported from `export_read` (their home since it split off).
    "VersionInfo",
    "LoadedVersion",
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
    "manifest_snapshots",
    "serving_manifest",
    "version_info",
    # Writing.
    "write_version",
    "write_version_to",
    "upload_version",
    # An exporter's exports location: a directory or a bucket.
    "bucket_of",
    "model_at",
    "versions_at",
    "resume_point",
    "write_model_version",
    "remove_version",
    "DEFAULT_FILE_MODE",
    "dir_mode",
    "write_tree",
    "fsync_dir",
    "HIDDEN_PREFIXES",
]

HIDDEN_PREFIXES = (".tmp-", ".old-", ".del-")
_CHUNK = 1 << 20

DEFAULT_FILE_MODE = 0o600
"""Mode of export files: this user only (their directories: 0700)."""


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
    slot_map: SlotMap | None = None,
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
    (and the model's, when this makes it) `dir_mode(file_mode)`. `slot_map`
    is the cluster's at the cut (`ps_core.slots`; None: the even map of
    `num_shards`, as before there were slots).
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
            slot_map=slot_map,
        )
    )


def write_version_to(store: ExportStore, *args: Any, **kwargs: Any) -> str:
    """`write_version` into any `ExportStore` (a local directory, an S3 bucket):
    the files, then the manifest, which makes the version visible; returns its
    location (`upload_version`, whose arguments it takes, with the manifest).
    `FileExistsError` if the version exists or appears meanwhile."""
    return upload_version(store, *args, **kwargs)[0]


def upload_version(
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
    slot_map: SlotMap | None = None,
) -> tuple[str, ExportManifest]:
    """Write one version into `store` (`write_version`'s arguments, a store in
    place of the root): the files, then the manifest, which makes it visible;
    returns its location and manifest. `FileExistsError` if the version
    exists or appears meanwhile."""
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
        "slot_map": slot_map,
    }
    try:
        manifest = _write_files(upload, fields, snapshots)
    except BaseException:
        upload.abort()
        raise
    return upload.commit(manifest.to_json()), manifest


# -- an exporter's location: a local directory or a store's bucket ---------------------
# A local exports directory is written as it always was (`write_version`); an
# ``s3://`` one through its store (`write_version_to`: a cut's data files, then
# its manifest, so a cut cut short is never listed).


def bucket_of(root: Path | str) -> ExportStore | None:
    """The store of an exports location given as a URL (``s3://bucket/prefix``);
    None for a local path, written as a directory as ever."""
    return store_for(str(root)) if "://" in str(root) else None


def model_at(root: Path, store: ExportStore | None, model: str) -> Path | StoredModel:
    """Model `model`'s versions: ``<root>/<model>``, or the store's model."""
    return StoredModel(store, model) if store is not None else root / model


def versions_at(where: Path | StoredModel) -> list[VersionInfo]:
    """`list_versions` of a model, none when its local directory does not exist."""
    if isinstance(where, Path) and not where.is_dir():
        return []
    return list_versions(where)


def resume_point(where: Path | StoredModel) -> tuple[int, dict[str, dict[int, int]]]:
    """The newest version of a model and its offsets ((0, {}) when none):
    where a coordinator starts so versions never collide."""
    versions = versions_at(where)
    if not versions:
        return 0, {}
    newest = versions[-1]
    return newest.version, {t: dict(p) for t, p in newest.manifest.offsets.items()}


def write_model_version(
    root: Path,
    store: ExportStore | None,
    model: str,
    version: int,
    parent: int | None,
    snapshots: Mapping[int, Sequence[TableSnapshot]],
    *args: Any,
    **kwargs: Any,
) -> tuple[str, int]:
    """Write one model's version of a cut (`write_version`'s arguments after
    the snapshots); returns where it is and its bytes (locally every file's,
    the manifest's too, as ever; in a store its data and serving files')."""
    if store is None:
        path = write_version(root, model, version, parent, snapshots, *args, **kwargs)
        return str(path), sum(p.stat().st_size for p in path.iterdir())
    where, manifest = upload_version(store, model, version, parent, snapshots, *args, **kwargs)
    return where, manifest.nbytes()


def remove_version(store: ExportStore | None, model: str, version: int, where: str) -> None:
    """Remove a version just written (a cut that could not be written whole):
    its directory, or its objects in the store, the manifest first."""
    if store is None:
        shutil.rmtree(where)
    else:
        store.delete_version(model, version)
