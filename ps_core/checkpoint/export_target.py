"""Where an `Exporter` puts its versions: a local exports directory (written
as it always was, `write_version`) or an export store's bucket (``s3://``,
`write_version_to`: a cut's data files, then its manifest, so a cut cut
short is never listed). A model's versions there are a local directory or a
`StoredModel`; the readers (`list_versions`, `latest_chain`) take either.
Synchronous: the exporter runs these in a thread."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..store.snapshot import TableSnapshot
from .export_files import VersionInfo, list_versions, store_manifest, write_version, write_version_to
from .exportstore import ExportStore, StoredModel, store_for
from .retention import prune, prune_stored

__all__ = [
    "bucket_of",
    "model_at",
    "prune_at",
    "remove_version",
    "resume_point",
    "versions_at",
    "write_model_version",
]


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
    where = write_version_to(store, model, version, parent, snapshots, *args, **kwargs)
    return where, store_manifest(store, model, version).nbytes()


def remove_version(store: ExportStore | None, model: str, version: int, where: str) -> None:
    """Remove a version just written (a cut that could not be written whole):
    its directory, or its objects in the store, the manifest first."""
    if store is None:
        shutil.rmtree(where)
    else:
        store.delete_version(model, version)


def prune_at(where: Path | StoredModel, keep_bases: int) -> list[int]:
    """Retention of a model's versions (`prune`, or `prune_stored` in a store)."""
    return prune_stored(where, keep_bases) if isinstance(where, StoredModel) else prune(where, keep_bases)
