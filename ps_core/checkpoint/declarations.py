"""Where a cluster keeps its models' declarations: ``<root>/<model>/model.json``
in a local exports directory or under a bucket's prefix (`ModelRegistry`).

`Declarations` lists the models declared, reads, writes and retires one
declaration. A local directory's are written through a temporary file and a
rename, fsynced; a bucket's are single PUTs (an object is whole or absent),
and retiring one copies it to ``model.json.deleted`` and then deletes it,
so a restart does not bring the model back and its files stay where they
are, as in a directory. Synchronous: callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from pathlib import Path

from .exportstore import ExportStore, ExportStoreError, LocalExportStore, S3ExportStore, store_for
from .manifest import check_model_name, is_model_name

__all__ = ["MODEL_FILE", "Declarations", "declarations_at"]

MODEL_FILE = "model.json"
"""A model's declaration in its exports directory."""

RETIRED = MODEL_FILE + ".deleted"
"""What a deleted model's declaration is renamed to."""


class Declarations(ABC):
    """The models' declarations under one exports root."""

    url: str
    """The root, for messages."""

    @abstractmethod
    def names(self) -> list[str]:
        """The models holding a declaration, sorted (a name that is not a
        model's is skipped)."""

    @abstractmethod
    def read(self, model: str) -> bytes:
        """Model `model`'s declaration; `OSError` if it cannot be read."""

    @abstractmethod
    def write(self, model: str, data: bytes) -> None:
        """Write `model`'s declaration whole (a reader sees the old or the new)."""

    @abstractmethod
    def retire(self, model: str) -> None:
        """Rename `model`'s declaration to `RETIRED` (none there: no change)."""

    def where(self, model: str) -> str:
        """Where `model`'s declaration is, for messages."""
        return f"{self.url.rstrip('/')}/{model}/{MODEL_FILE}"


class DirDeclarations(Declarations):
    """Declarations in a local exports directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob(f"*/{MODEL_FILE}") if is_model_name(p.parent.name))

    def read(self, model: str) -> bytes:
        return (self.root / model / MODEL_FILE).read_bytes()

    def write(self, model: str, data: bytes) -> None:
        mdir = self.root / check_model_name(model)
        mdir.mkdir(parents=True, exist_ok=True)
        path = mdir / MODEL_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def retire(self, model: str) -> None:
        path = self.root / check_model_name(model) / MODEL_FILE
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, path.with_name(RETIRED))


class BucketDeclarations(Declarations):
    """Declarations under a bucket's prefix (`S3ExportStore`)."""

    def __init__(self, store: S3ExportStore) -> None:
        self.store = store
        self.url = store.url

    def names(self) -> list[str]:
        out = []
        for name in self.store.top_level():
            if is_model_name(name) and self.store.object_size(f"{name}/{MODEL_FILE}") is not None:
                out.append(name)
        return sorted(out)

    def read(self, model: str) -> bytes:
        key = f"{check_model_name(model)}/{MODEL_FILE}"
        data = self.store.read_object(key)
        if data is None:
            raise FileNotFoundError(f"{self.store.url_of(key)}: not found")
        return data

    def write(self, model: str, data: bytes) -> None:
        self.store.write_object(f"{check_model_name(model)}/{MODEL_FILE}", data, replace=True)

    def retire(self, model: str) -> None:
        key = f"{check_model_name(model)}/{MODEL_FILE}"
        data = self.store.read_object(key)
        if data is None:
            return
        # Copied before the declaration goes: a crash between leaves both,
        # and the model is still declared (as before the delete), never lost.
        self.store.write_object(f"{model}/{RETIRED}", data, replace=True)
        self.store.delete_object(key)


def declarations_at(root: Path | str | ExportStore) -> Declarations:
    """The declarations of an exports root: a local directory, an ``s3://``
    URL or a store. `ExportStoreError` for a store of no other kind."""
    if isinstance(root, S3ExportStore):
        return BucketDeclarations(root)
    if isinstance(root, LocalExportStore):
        return DirDeclarations(root.root)
    if isinstance(root, ExportStore):
        raise ExportStoreError(f"{root.url}: model declarations are kept in a directory or an s3:// bucket")
    text = str(root)
    if "://" in text:
        return declarations_at(store_for(text))
    return DirDeclarations(Path(text))
