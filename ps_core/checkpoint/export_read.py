"""Reading export versions: list, verify, load, find the latest chain
(writing: `export_files`, which re-exports these).

Every reader takes a version's `VersionSource`: a local version directory
(a `Path` is one, read in place as it always was) or a store's version
located by (store, model, version) (`stored_version`; an ``s3://`` bucket's
files are read whole, one GET each). Listing and `latest_chain` take a local
model directory or a `StoredModel`; a store lists a version only once its
manifest exists, so an upload cut short is never seen. Files are checked
against the manifest's sizes and SHA-256s; a mismatch is an
`ExportCorruptError` naming the file (its path or ``s3://`` key).
Synchronous: callers run these in a thread.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ExportCorruptError, ExportNotFoundError
from ..store.snapshot import SnapshotKind, TableSnapshot
from .exportstore import DirVersion, ExportStore, StoredModel, VersionSource, local_version_dirs, stored_version
from .manifest import MANIFEST_NAME, ExportManifest, ManifestFile
from .serving_files import INT8_ARRAYS, SERVING_ARRAYS, serving_config, serving_snapshot

__all__ = [
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
]

Where = Path | str | VersionSource
"""A version: its local directory, or any `VersionSource`."""


def _source(where: Where) -> VersionSource:
    return where if isinstance(where, VersionSource) else DirVersion(Path(where))


@dataclass(frozen=True)
class VersionInfo:
    """A complete version, as listed."""

    version: int
    """The version number."""
    kind: SnapshotKind
    """``"base"`` or ``"delta"``."""
    parent: int | None
    """The version a delta applies on top of; None for a base."""
    created_at: datetime
    """When the cut was taken (UTC)."""
    source: VersionSource
    """Where its files are."""
    manifest: ExportManifest
    """Its manifest."""

    @property
    def path(self) -> Path:
        """The version directory, for a local version; `ValueError` for one in
        object storage (read it through `source`)."""
        if not isinstance(self.source, DirVersion):
            raise ValueError(f"export version {self.location} is not a local directory")
        return self.source.path

    @property
    def location(self) -> str:
        """Where the version is: its directory or ``s3://`` prefix."""
        return self.source.where()

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


def read_manifest(version_dir: Where) -> ExportManifest:
    """A version's manifest; `ExportCorruptError` if missing or malformed, or if
    it names another version than its location."""
    src = _source(version_dir)
    try:
        raw: bytes | None = src.read(MANIFEST_NAME)
    except FileNotFoundError:
        raw = None
    return _checked_manifest(raw, src.where(MANIFEST_NAME), src.version)


def store_manifest(store: ExportStore, model: str, version: int) -> ExportManifest:
    """`read_manifest` of a version in an `ExportStore`."""
    return read_manifest(stored_version(store, model, version))


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


def _versions(model: Path | StoredModel) -> dict[int, VersionSource]:
    """A local model directory's or a store's model's visible versions."""
    if isinstance(model, StoredModel):
        return model.versions()
    return {v: DirVersion(p) for v, p in version_dirs(Path(model)).items()}


def version_info(path: Where, manifest: ExportManifest) -> VersionInfo:
    return VersionInfo(manifest.version, manifest.kind, manifest.parent, manifest.created_at, _source(path), manifest)


def list_versions(model_dir: Path | StoredModel) -> list[VersionInfo]:
    """The versions of a model (a local directory, or a `StoredModel`), oldest first.

    Hidden entries (writes in progress, compaction and pruning leftovers) are
    never listed; neither are versions whose manifest is missing or
    unreadable (`latest_chain` reports those). Files are not checked.
    """
    found = _versions(model_dir)
    return [version_info(found[v], m) for v, m in _readable(found, lambda v: read_manifest(found[v]))]


def store_versions(store: ExportStore, model: str) -> list[tuple[str, ExportManifest]]:
    """`list_versions` of a model in an `ExportStore`: each visible version's
    location and manifest, oldest first; unreadable manifests are skipped."""
    return [(i.location, i.manifest) for i in list_versions(StoredModel(store, model))]


def _readable(
    versions: Mapping[int, object], read: Callable[[int], ExportManifest]
) -> Iterator[tuple[int, ExportManifest]]:
    """Each version's manifest, oldest first, skipping those that do not read."""
    for v in sorted(versions):
        try:
            yield v, read(v)
        except ExportCorruptError:
            continue


def _check_file(src: VersionSource, entry: ManifestFile, verify: bool, fetch: bool = False) -> bytes | None:
    """Check a file against its entry: present with the right size, and, when
    `verify`, the right SHA-256. With `verify` or `fetch` its bytes are read
    once (one request from a store) and returned; otherwise only its size is."""
    where = src.where(entry.name)
    raw: bytes | None = None
    if verify or fetch:
        try:
            raw = src.read(entry.name)
        except FileNotFoundError:
            raw = None
        size = None if raw is None else len(raw)
    else:
        size = src.size(entry.name)
    if size is None:
        raise ExportCorruptError(
            f"{where}: missing (manifest expects {entry.bytes} bytes, sha256 {entry.sha256})",
            file=where,
            expected=entry.sha256,
            actual="missing",
        )
    if size != entry.bytes:
        raise ExportCorruptError(
            f"{where}: {size} bytes, manifest expects {entry.bytes} (sha256 {entry.sha256})",
            file=where,
            expected=f"{entry.bytes} bytes",
            actual=f"{size} bytes",
        )
    if verify:
        digest = hashlib.sha256(raw or b"").hexdigest()
        if digest != entry.sha256:
            raise ExportCorruptError(
                f"{where}: sha256 {digest}, manifest expects {entry.sha256}",
                file=where,
                expected=entry.sha256,
                actual=digest,
            )
    return raw


def verify_version(version_dir: Where) -> ExportManifest:
    """Check every file of a version (presence, size, SHA-256); returns the manifest."""
    src = _source(version_dir)
    manifest = read_manifest(src)
    for entry in manifest.files + manifest.serving_files:
        _check_file(src, entry, verify=True)
    return manifest


def _read_snapshot(
    src: VersionSource, manifest: ExportManifest, entry: ManifestFile, verify: bool, serving: bool = False
) -> TableSnapshot:
    """The snapshot a data file holds, or with `serving` a serving file's (as
    the snapshot of its `serving_config` table)."""
    # A remote file is read whole, once: its size checked on those bytes.
    raw = _check_file(src, entry, verify, fetch=src.remote)
    where = src.where(entry.name)
    local = src.local(entry.name)
    source: Path | io.BytesIO = local if raw is None and local is not None else io.BytesIO(raw or b"")
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
        raise ExportCorruptError(f"{where}: unreadable: {type(exc).__name__}: {exc}", file=where) from None
    if (snap.rows, int(snap.deleted.size)) != (entry.rows, entry.deleted):
        raise ExportCorruptError(
            f"{where}: {snap.rows} rows and {snap.deleted.size} deletions, manifest says "
            f"{entry.rows} and {entry.deleted}",
            file=where,
            expected=f"{entry.rows} rows",
            actual=f"{snap.rows} rows",
        )
    return snap


def iter_version(version_dir: Where, verify: bool = True) -> Iterator[tuple[int, TableSnapshot]]:
    """(shard, snapshot) for each file of a version, one file in memory at a time.

    With `verify`, each file's SHA-256 is checked before it is parsed (the
    parsed bytes are the checked ones); otherwise only its size.
    """
    src = _source(version_dir)
    return manifest_snapshots(src, read_manifest(src), verify)


def manifest_snapshots(
    vdir: Where, manifest: ExportManifest, verify: bool, serving: bool = False
) -> Iterator[tuple[int, TableSnapshot]]:
    """(shard, snapshot) of each data file (with `serving`, serving file) that
    `manifest` lists, read from `vdir`: what a restore applies."""
    src = _source(vdir)
    for entry in manifest.serving_files if serving else manifest.files:
        yield entry.shard, _read_snapshot(src, manifest, entry, verify, serving)


def serves_weights(manifest: ExportManifest) -> bool:
    """Whether a version has serving files for every data file
    (`ps_core.checkpoint.serving_files`); versions written before them have none."""
    return len(manifest.serving_files) == len(manifest.files)


def serving_manifest(manifest: ExportManifest) -> ExportManifest:
    """The manifest as a replica of weights applies it: its tables' `serving_config`."""
    return replace(manifest, tables={name: serving_config(c) for name, c in manifest.tables.items()})


def load_version(version_dir: Where, verify: bool = True, *, serving: bool = False) -> LoadedVersion:
    """A whole version in memory; `ExportCorruptError` names the first bad file.

    With `serving`, its serving files, as the snapshots of `serving_config`
    tables (and the manifest's tables are those): what a replica applies."""
    src = _source(version_dir)
    manifest = read_manifest(src)
    snapshots: dict[int, list[TableSnapshot]] = {i: [] for i in range(manifest.num_shards)}
    for shard, snap in manifest_snapshots(src, manifest, verify, serving):
        snapshots.setdefault(shard, []).append(snap)
    return LoadedVersion(serving_manifest(manifest) if serving else manifest, snapshots)


def _chain_to(
    version: int, found: Mapping[int, VersionSource], verify: bool, serving: bool = False
) -> list[VersionInfo]:
    """The chain ending at `version`, base first, every file checked (with
    `serving`, the serving files of versions that have them instead)."""
    chain: list[VersionInfo] = []
    v: int | None = version
    while v is not None:
        src = found.get(v)
        if src is None:
            child = chain[-1]
            raise ExportCorruptError(
                f"version {child.version} ({child.location}) has parent {v}, which is missing",
                file=child.source.sibling(v),
                expected=f"version {v}",
                actual="missing",
            )
        manifest = read_manifest(src)
        for entry in manifest.serving_files if serving and serves_weights(manifest) else manifest.files:
            _check_file(src, entry, verify)
        chain.append(version_info(src, manifest))
        v = manifest.parent
    chain.reverse()
    return chain


def latest_chain(
    model_dir: Path | StoredModel,
    upto: int | None = None,
    *,
    fallback: bool = False,
    verify: bool = False,
    serving: bool = False,
) -> list[VersionInfo]:
    """The newest complete chain (base first, each delta's parent before it)
    ending at the newest version ``<= upto`` (any version when None), of a
    local model directory or a `StoredModel`.

    Each version's manifest must read and every file be present with its
    size; with `verify`, its SHA-256 too (reading everything). When the
    newest version fails, that is an `ExportCorruptError` unless `fallback`,
    which tries the next older version instead. `ExportNotFoundError` when
    there is no version, or (with fallback) no complete chain. With
    `serving`, the files checked are a replica's: the serving files of the
    versions that have them.
    """
    found = _versions(model_dir)
    candidates = sorted((v for v in found if upto is None or v <= upto), reverse=True)
    if not candidates:
        raise ExportNotFoundError(f"no export version{'' if upto is None else f' <= {upto}'} in {model_dir}")
    failures: list[str] = []
    for v in candidates:
        try:
            return _chain_to(v, found, verify, serving)
        except ExportCorruptError as exc:
            if not fallback:
                raise
            failures.append(f"{v}: {exc.detail}")
    raise ExportNotFoundError(f"no complete chain in {model_dir}: " + "; ".join(failures))
