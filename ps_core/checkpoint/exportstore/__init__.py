"""Where export versions live: a local directory or an S3 bucket and prefix.

An `ExportStore` holds models' versions as ``<model>/<version>/<file>``
(the version zero-padded, `version_dir_name`), the layout of
docs/export-format.md, and does only what writing, listing, reading and
pruning versions need: `begin` a version's upload (files first, its
manifest last: a version is visible only once complete, and never
overwritten), list a model's `versions`, `size` and read a file whole
(`read_bytes`) or in chunks (`iter_bytes`), `delete_version`.

`LocalExportStore` is the on-disk layout as it has always been: a version is
written into a hidden ``.tmp-`` directory, fsynced, and renamed into place.
`S3ExportStore` (obstore, the ``s3`` extra) writes the data files, then the
manifest with a create-only PUT (``If-None-Match: *``); a version is listed
once its manifest exists. Its credentials come from the AWS environment
variables, else the profile in the AWS shared files (`aws_profile`), else
web identity, container or instance credentials; its endpoint from ``AWS_ENDPOINT_URL`` or
`S3Options.endpoint` (S3-compatible servers); every request has bounded
timeouts and retries, and a failure is one `ExportStoreError` line naming
the ``s3://`` location and the cause. `store_for` picks one from a path or
an ``s3://bucket/prefix`` URL. A version is read through its
`VersionSource` (`stored_version(store, model, version)`; a model's versions
are a `StoredModel`). Synchronous: callers run it in a thread.
"""

from __future__ import annotations

from pathlib import Path

from .base import READ_CHUNK, BinaryWriter, ExportStore, ExportStoreError, VersionUpload
from .local import LocalExportStore, LocalUpload, dir_mode, fsync_dir, local_version_dirs, make_dir
from .s3 import S3ExportStore, S3Options
from .source import DirVersion, StoredModel, StoredVersion, VersionSource, stored_version

__all__ = [
    "READ_CHUNK",
    "BinaryWriter",
    "DirVersion",
    "ExportStore",
    "ExportStoreError",
    "LocalExportStore",
    "LocalUpload",
    "S3ExportStore",
    "S3Options",
    "StoredModel",
    "StoredVersion",
    "VersionSource",
    "VersionUpload",
    "dir_mode",
    "fsync_dir",
    "local_version_dirs",
    "make_dir",
    "model_at",
    "store_for",
    "stored_version",
]


def store_for(url_or_path: str | Path, s3: S3Options | None = None) -> ExportStore:
    """The store of an exports location: ``s3://bucket/prefix`` or a local path.
    `ValueError` (one line) for any other ``scheme://``."""
    text = str(url_or_path)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalExportStore(Path(text))
    if scheme.lower() == "s3":
        bucket, _, prefix = rest.partition("/")
        return S3ExportStore(bucket, prefix, s3)
    raise ValueError(
        f"exports location {text!r}: scheme {scheme!r} is not supported (a local path or s3://bucket/prefix)"
    )


def model_at(url_or_path: str | Path, s3: S3Options | None = None) -> Path | StoredModel:
    """A model's exports from their location: a local model directory, or
    ``s3://bucket/prefix/<model>`` as that store's model. `ValueError` (one
    line) for another scheme or an ``s3://`` URL without a model."""
    text = str(url_or_path)
    if "://" not in text:
        return Path(text)
    root, _, model = text.rstrip("/").rpartition("/")
    if not model or root.endswith(":/"):
        raise ValueError(f"exports location {text!r}: name the model's, s3://bucket/prefix/<model>")
    return StoredModel(store_for(root, s3), model)
