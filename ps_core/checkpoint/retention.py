"""Compaction and retention of a model's export versions: `compact` folds
the newest chain into a base of its newest version, `prune` removes versions
no chain kept needs (and stale hidden directories). Synchronous file work."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import ExportNotFoundError
from .export_files import (
    DEFAULT_FILE_MODE,
    HIDDEN_PREFIXES,
    VersionInfo,
    fsync_dir,
    latest_chain,
    list_versions,
    version_dirs,
    version_info,
    write_tree,
)
from .exportstore import S3ExportStore, StoredModel
from .manifest import (
    version_dir_name,
)
from .restore import restore_shards

__all__ = ["compact", "prune", "prune_at", "prune_stored"]


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
    tmp, manifest = write_tree(mdir, fields, snapshots, file_mode)
    old = mdir / f".old-{version_dir_name(last.version)}-{secrets.token_hex(4)}"
    os.rename(last.path, old)
    try:
        os.rename(tmp, last.path)
    except BaseException:
        os.rename(old, last.path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(mdir)
    shutil.rmtree(old)
    return version_info(last.path, manifest)


def prune(model_dir: Path, keep_bases: int = 2, *, stale_after_s: float = 3600.0) -> list[int]:
    """Remove every version older than the oldest of the newest `keep_bases`
    bases; returns the removed versions.

    Nothing is removed while there are no more than `keep_bases` bases, so
    every kept delta still has its chain. Each removed version is first
    renamed to a hidden name, so no reader sees it half deleted. Hidden
    leftovers (interrupted writes, compactions, prunes) older than
    `stale_after_s` are removed too.
    """
    mdir = Path(model_dir)
    oldest_kept = _oldest_kept(list_versions(mdir), keep_bases)
    removed: list[int] = []
    if oldest_kept is not None:
        for v, path in sorted(version_dirs(mdir).items()):
            if v >= oldest_kept:
                continue
            doomed = mdir / f".del-{version_dir_name(v)}-{secrets.token_hex(4)}"
            os.rename(path, doomed)
            removed.append(v)
            shutil.rmtree(doomed)
        if removed:
            fsync_dir(mdir)
    now = time.time()
    for e in list(os.scandir(mdir)):
        if not e.name.startswith(HIDDEN_PREFIXES):
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


def _oldest_kept(versions: list[VersionInfo], keep_bases: int) -> int | None:
    """The oldest of the newest `keep_bases` bases, below which versions go;
    None while there are no more than `keep_bases` bases."""
    if keep_bases < 1:
        raise ValueError("keep_bases must be >= 1")
    bases = sorted(i.version for i in versions if i.kind == "base")
    return bases[-keep_bases] if len(bases) > keep_bases else None


def prune_stored(model: StoredModel, keep_bases: int = 2) -> list[int]:
    """`prune` of a model's versions in a store (an S3 bucket), by the same
    rule; returns the removed versions. Oldest first, each by
    `ExportStore.delete_version`: its manifest first, so a version half
    deleted is never listed, and an interrupted prune leaves every kept
    chain whole. On a bucket the objects of uploads cut short (no
    manifest) below the newest version go too."""
    versions = list_versions(model)
    if versions and isinstance(model.store, S3ExportStore):
        # The local sweep of stale hidden directories, on a bucket: the
        # objects of uploads a crash cut short, below the newest version.
        model.store.drop_unlisted(model.model, versions[-1].version)
    oldest_kept = _oldest_kept(versions, keep_bases)
    if oldest_kept is None:
        return []
    doomed = sorted(v for v in model.store.versions(model.model) if v < oldest_kept)
    return [v for v in doomed if model.store.delete_version(model.model, v)]


def prune_at(where: Path | StoredModel, keep_bases: int) -> list[int]:
    """Retention of a model's versions (`prune`, or `prune_stored` in a store)."""
    return prune_stored(where, keep_bases) if isinstance(where, StoredModel) else prune(where, keep_bases)
