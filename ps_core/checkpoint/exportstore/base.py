"""The export store's interface: `ExportStore` and the `VersionUpload` it
begins (`ps_core.checkpoint.exportstore`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from types import TracebackType
from typing import Protocol, Self

from ..manifest import check_model_name, version_dir_name

READ_CHUNK = 8 << 20


class ExportStoreError(OSError):
    """A store operation failed: one line naming where and why."""


class BinaryWriter(Protocol):
    """A write-only byte stream (what `VersionUpload.open` returns)."""

    def write(self, b: bytes | bytearray | memoryview, /) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None, /) -> None: ...


class VersionUpload(ABC):
    """One version being written: its files (`open`, each closed before the
    next), then `commit` with the manifest, which makes it visible; `abort`
    drops what was written (a version never committed is never visible)."""

    @abstractmethod
    def open(self, name: str) -> BinaryWriter:
        """A new file of the version, write-only; durable once closed."""

    @abstractmethod
    def commit(self, manifest: bytes) -> str:
        """Write the manifest last and make the version visible; returns its
        location. `FileExistsError` if the version appeared meanwhile."""

    @abstractmethod
    def abort(self) -> None:
        """Remove what was written (best effort: an uncommitted version is
        invisible anyway)."""


class ExportStore(ABC):
    """The export versions of every model under one root (see the module)."""

    url: str
    """The root, as given to `store_for` (a path or ``s3://bucket/prefix``)."""

    @abstractmethod
    def begin(self, model: str, version: int, *, file_mode: int = 0o600) -> VersionUpload:
        """Start writing a version; `FileExistsError` if it exists. Local files
        get `file_mode` (object storage has no modes)."""

    @abstractmethod
    def versions(self, model: str) -> dict[int, str]:
        """Version number → location of every visible version of a model (none
        when the model has none); no manifest is parsed."""

    @abstractmethod
    def size(self, model: str, version: int, name: str) -> int | None:
        """A file's size in bytes; None if it does not exist."""

    @abstractmethod
    def read_bytes(self, model: str, version: int, name: str) -> bytes:
        """A file's bytes; `FileNotFoundError` if it does not exist."""

    @abstractmethod
    def iter_bytes(self, model: str, version: int, name: str, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        """A file's bytes in pieces of about `chunk` bytes, for reading one
        larger than memory should hold twice; `FileNotFoundError` if missing."""

    @abstractmethod
    def top_level(self) -> list[str]:
        """The names directly under the root that hold something (models'
        names among them), sorted; hidden ones (``.``) left out."""

    @abstractmethod
    def delete_version(self, model: str, version: int) -> bool:
        """Remove a version (its manifest first, so no reader sees it half
        gone); False if it did not exist."""

    def location(self, model: str, version: int, name: str | None = None) -> str:
        """Where a version (or one of its files) is, for messages."""
        key = f"{check_model_name(model)}/{version_dir_name(version)}"
        return f"{self.url.rstrip('/')}/{key}" + (f"/{name}" if name else "")
