"""Where a version's files are read from (`VersionSource`): a local
directory (`DirVersion`, read as it always was) or a version of a store
located by (store, model, version) (`StoredVersion`, one GET per file read);
a model's versions in a store (`StoredModel`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ..manifest import check_model_name, parse_version_dir, version_dir_name
from .base import ExportStore
from .local import LocalExportStore, local_version_dirs


class VersionSource(ABC):
    """One version's files, wherever they are."""

    remote: bool = False
    """Whether a file is read whole into memory (one request) rather than
    opened in place."""

    @property
    @abstractmethod
    def version(self) -> int | None:
        """The version its location names (None: a name that is no version)."""

    @abstractmethod
    def where(self, name: str | None = None) -> str:
        """The version's (or one of its files') location, for messages."""

    @abstractmethod
    def sibling(self, version: int) -> str:
        """Where another version of the same model would be."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """A file's size; None if it does not exist."""

    @abstractmethod
    def read(self, name: str) -> bytes:
        """A file's bytes; `FileNotFoundError` if it does not exist."""

    def local(self, name: str) -> Path | None:
        """A file's local path, when it has one (read in place)."""
        return None

    def __str__(self) -> str:
        return self.where()


@dataclass(frozen=True, eq=True)
class DirVersion(VersionSource):
    """A version directory on disk, whatever its name."""

    path: Path

    @property
    def version(self) -> int | None:
        return parse_version_dir(self.path.name)

    def where(self, name: str | None = None) -> str:
        return str(self.path / name) if name else str(self.path)

    def sibling(self, version: int) -> str:
        return str(self.path.parent / version_dir_name(version))

    def size(self, name: str) -> int | None:
        try:
            return (self.path / name).stat().st_size
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def local(self, name: str) -> Path:
        return self.path / name


@dataclass(frozen=True, eq=True)
class StoredVersion(VersionSource):
    """A version of a store, located by (store, model, version)."""

    store: ExportStore
    model: str
    number: int
    remote = True

    @property
    def version(self) -> int:
        return self.number

    def where(self, name: str | None = None) -> str:
        return self.store.location(self.model, self.number, name)

    def sibling(self, version: int) -> str:
        return self.store.location(self.model, version)

    def size(self, name: str) -> int | None:
        return self.store.size(self.model, self.number, name)

    def read(self, name: str) -> bytes:
        return self.store.read_bytes(self.model, self.number, name)


@dataclass(frozen=True, eq=True)
class StoredModel:
    """A model's versions in a store (what `list_versions` and `latest_chain`
    take in place of a local model directory)."""

    store: ExportStore
    model: str

    def versions(self) -> dict[int, VersionSource]:
        """Every visible version (no manifest parsed)."""
        if isinstance(self.store, LocalExportStore):
            # Read in place, as a local model directory is.
            return {v: DirVersion(p) for v, p in local_version_dirs(self.store.model_dir(self.model)).items()}
        return {v: StoredVersion(self.store, self.model, v) for v in self.store.versions(self.model)}

    def __str__(self) -> str:
        return f"{self.store.url.rstrip('/')}/{check_model_name(self.model)}"


def stored_version(store: ExportStore, model: str, version: int) -> VersionSource:
    """The version `version` of `model` in `store`: a local store's is its
    directory (read in place, as ever), another's is read through the store."""
    if isinstance(store, LocalExportStore):
        return DirVersion(store.model_dir(model) / version_dir_name(version))
    return StoredVersion(store, check_model_name(model), version)
