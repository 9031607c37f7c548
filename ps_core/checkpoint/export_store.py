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
once its manifest exists. Its credentials come only from the AWS
environment variables; its endpoint from ``AWS_ENDPOINT_URL`` or
`S3Options.endpoint` (S3-compatible servers); every request has bounded
timeouts and retries, and a failure is one `ExportStoreError` line naming
the ``s3://`` location and the cause. `store_for` picks one from a path or
an ``s3://bucket/prefix`` URL. Synchronous: callers run it in a thread.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, Self

from .manifest import MANIFEST_NAME, check_model_name, parse_version_dir, version_dir_name

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = [
    "ExportStore",
    "ExportStoreError",
    "LocalExportStore",
    "LocalUpload",
    "S3ExportStore",
    "S3Options",
    "BinaryWriter",
    "VersionUpload",
    "store_for",
]

READ_CHUNK = 8 << 20


class ExportStoreError(OSError):
    """A store operation failed: one line naming where and why."""


def _one_line(exc: BaseException) -> str:
    """An exception as one line (obstore's are multi-line, with the whole
    chain of causes, then a "Debug source:" dump of the same): its type and
    its whitespace-collapsed text, without the dump."""
    text = str(exc).split("Debug source:", 1)[0]
    return f"{type(exc).__name__}: {' '.join(text.split())}"


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
    def delete_version(self, model: str, version: int) -> bool:
        """Remove a version (its manifest first, so no reader sees it half
        gone); False if it did not exist."""

    def location(self, model: str, version: int, name: str | None = None) -> str:
        """Where a version (or one of its files) is, for messages."""
        key = f"{check_model_name(model)}/{version_dir_name(version)}"
        return f"{self.url.rstrip('/')}/{key}" + (f"/{name}" if name else "")


# -- local ------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """fsync a directory: what makes a rename or an unlink in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_mode(file_mode: int) -> int:
    """The mode of directories holding files of `file_mode`: ``x`` wherever ``r``."""
    return file_mode | ((file_mode & 0o444) >> 2)


def make_dir(path: Path, file_mode: int, *, exist_ok: bool = False) -> None:
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


class _DurableFile(io.BufferedWriter):
    """A new local file, flushed and fsynced when it is closed."""

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()
                os.fsync(self.fileno())
            finally:
                super().close()


class LocalUpload(VersionUpload):
    """A local version being written: a hidden ``.tmp-<version>-<random>`` directory of the model's, 0700
    while written; at commit its files get `file_mode`, it gets
    `dir_mode(file_mode)`, everything is fsynced, and one rename shows it."""

    def __init__(self, model_dir: Path, version: int, file_mode: int) -> None:
        self.model_dir = model_dir
        self.version = version
        self.final = model_dir / version_dir_name(version)
        self.file_mode = file_mode
        self.tmp = model_dir / f".tmp-{version_dir_name(version)}-{secrets.token_hex(4)}"
        make_dir(self.tmp, 0o600)
        self._open: _DurableFile | None = None

    def open(self, name: str) -> _DurableFile:
        self._close_open()
        self._open = _DurableFile(io.FileIO(self.tmp / name, "x"))
        return self._open

    def _close_open(self) -> None:
        f, self._open = self._open, None
        if f is not None:
            f.close()

    def seal(self, manifest: bytes) -> Path:
        """Everything `commit` does but the rename: the hidden directory, complete
        and fsynced (what compaction swaps in itself)."""
        try:
            self._close_open()
            with open(self.tmp / MANIFEST_NAME, "xb") as f:
                f.write(manifest)
                f.flush()
                os.fsync(f.fileno())
            for written in self.tmp.iterdir():
                os.chmod(written, self.file_mode)
            os.chmod(self.tmp, dir_mode(self.file_mode))
            fsync_dir(self.tmp)
        except BaseException:
            self.abort()
            raise
        return self.tmp

    def commit(self, manifest: bytes) -> str:
        self.seal(manifest)
        try:
            # rename(2) would replace an empty directory created meanwhile;
            # `begin`'s check makes that a race between two writers of one version.
            if self.final.exists():
                raise FileExistsError(f"export version {self.version} exists: {self.final}")
            os.rename(self.tmp, self.final)
        except OSError as exc:
            self.abort()
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"export version {self.version} exists: {self.final}") from None
            raise
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.model_dir)
        return str(self.final)

    def abort(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None
        shutil.rmtree(self.tmp, ignore_errors=True)


class LocalExportStore(ExportStore):
    """Versions as directories under a local root (the layout of
    docs/export-format.md)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = str(root)

    def model_dir(self, model: str) -> Path:
        return self.root / check_model_name(model)

    def _file(self, model: str, version: int, name: str) -> Path:
        return self.model_dir(model) / version_dir_name(version) / name

    def begin(self, model: str, version: int, *, file_mode: int = 0o600) -> LocalUpload:
        mdir = self.model_dir(model)
        make_dir(mdir, file_mode, exist_ok=True)
        final = mdir / version_dir_name(version)
        if final.exists():
            raise FileExistsError(f"export version {version} exists: {final}")
        return LocalUpload(mdir, version, file_mode)

    def versions(self, model: str) -> dict[int, str]:
        return {v: str(p) for v, p in local_version_dirs(self.model_dir(model)).items()}

    def size(self, model: str, version: int, name: str) -> int | None:
        try:
            return self._file(model, version, name).stat().st_size
        except FileNotFoundError:
            return None

    def read_bytes(self, model: str, version: int, name: str) -> bytes:
        return self._file(model, version, name).read_bytes()

    def iter_bytes(self, model: str, version: int, name: str, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        with open(self._file(model, version, name), "rb") as f:
            while piece := f.read(chunk):
                yield piece

    def delete_version(self, model: str, version: int) -> bool:
        mdir = self.model_dir(model)
        path = local_version_dirs(mdir).get(version)
        if path is None:
            return False
        # Renamed to a hidden name first: no reader sees it half deleted.
        doomed = mdir / f".del-{version_dir_name(version)}-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        fsync_dir(mdir)
        shutil.rmtree(doomed)
        return True


def local_version_dirs(model_dir: Path) -> dict[int, Path]:
    """Version number → directory for every visible version name (hidden
    temporaries and anything not a number are skipped); no manifest is read."""
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


# -- S3 ---------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible server. Credentials are not here: they
    come from the AWS environment variables only."""

    endpoint: str | None = None
    """The server's URL (MinIO, a test server); default ``AWS_ENDPOINT_URL``,
    else AWS's own. Plain ``http://`` is allowed for an explicit endpoint."""
    region: str | None = None
    """Default ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else us-east-1."""
    connect_timeout_s: float = 5.0
    """Per connection attempt."""
    request_timeout_s: float = 300.0
    """Per request, whole (a multipart upload's part, a whole-file GET)."""
    max_retries: int = 3
    """Retries of a failing request (connection errors, 5xx, throttling)."""
    retry_timeout_s: float = 60.0
    """No retry starts after this long since the first attempt."""


class _S3Upload(VersionUpload):
    def __init__(self, store: S3ExportStore, model: str, version: int) -> None:
        self.store = store
        self.model = model
        self.version = version
        self.written: list[str] = []

    def open(self, name: str) -> BinaryWriter:
        import obstore

        key = self.store.key(self.model, self.version, name)
        self.written.append(key)
        return _S3Writer(self.store, key, obstore.open_writer(self.store.client, key))

    def commit(self, manifest: bytes) -> str:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = self.store.key(self.model, self.version, MANIFEST_NAME)
        try:
            obstore.put(self.store.client, key, manifest, mode="create")
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            raise FileExistsError(f"export version {self.version} exists: {self.store.url_of(key)}") from None
        except Exception as exc:
            self.store.fail("put", key, exc)
        return self.store.location(self.model, self.version)

    def abort(self) -> None:
        import obstore

        try:
            obstore.delete(self.store.client, self.written)
        except Exception:  # noqa: BLE001 - best effort: uncommitted files are invisible
            pass


class _S3Writer:
    """obstore's buffered writer (multipart past its buffer), its errors as
    `ExportStoreError` naming the key."""

    def __init__(self, store: S3ExportStore, key: str, inner: Any) -> None:
        self._store, self._key, self._inner = store, key, inner
        self._closed = False

    def write(self, b: bytes | bytearray | memoryview, /) -> int:
        try:
            return int(self._inner.write(b))
        except Exception as exc:
            self._store.fail("upload", self._key, exc)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except Exception as exc:
            self._store.fail("upload", self._key, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._inner.close()
        except Exception as exc:
            self._store.fail("upload", self._key, exc)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> _S3Writer:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None, /) -> None:
        self.close()


class S3ExportStore(ExportStore):
    """Versions as objects ``<prefix>/<model>/<version>/<file>`` of a bucket,
    through obstore (the ``s3`` extra)."""

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None) -> None:
        try:
            from obstore.store import S3Store
        except ImportError:
            raise ExportStoreError("exports on s3:// need obstore: pip install 'ctrps[s3]'") from None
        if not bucket:
            raise ValueError("an s3:// export location needs a bucket: s3://bucket/prefix")
        self.options = opts = options or S3Options()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        endpoint = opts.endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        region = opts.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        config["region"] = region or "us-east-1"
        self.client: S3Store = S3Store(
            bucket,
            prefix=self.prefix or None,
            client_options={
                "connect_timeout": timedelta(seconds=opts.connect_timeout_s),
                "timeout": timedelta(seconds=opts.request_timeout_s),
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
            },
            retry_config={
                "max_retries": opts.max_retries,
                "retry_timeout": timedelta(seconds=opts.retry_timeout_s),
                "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5)},
            },
            **config,
        )

    def key(self, model: str, version: int, name: str = "") -> str:
        """The object key (under the prefix) of a version's file."""
        return f"{check_model_name(model)}/{version_dir_name(version)}/{name}"

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}"

    def fail(self, op: str, key: str, exc: BaseException) -> NoReturn:
        """Raise the one-line error of a failed request."""
        raise ExportStoreError(f"{self.url_of(key)}: {op} failed: {_one_line(exc)}") from exc

    def begin(self, model: str, version: int, *, file_mode: int = 0o600) -> VersionUpload:
        if self.size(model, version, MANIFEST_NAME) is not None:
            raise FileExistsError(f"export version {version} exists: {self.location(model, version)}")
        return _S3Upload(self, model, version)

    def versions(self, model: str) -> dict[int, str]:
        import obstore

        head = f"{check_model_name(model)}/"
        out: dict[int, str] = {}
        try:
            for batch in obstore.list(self.client, head, chunk_size=1000):
                for meta in batch:
                    parts = meta["path"][len(head) :].split("/")
                    # A version is visible once its manifest is: the data
                    # files of an interrupted upload are not listed.
                    if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                        v = parse_version_dir(parts[0])
                        if v is not None and parts[0] == version_dir_name(v):
                            out[v] = self.url_of(f"{head}{parts[0]}")
        except Exception as exc:
            self.fail("list", head, exc)
        return out

    def size(self, model: str, version: int, name: str) -> int | None:
        import obstore
        from obstore.exceptions import NotFoundError

        key = self.key(model, version, name)
        try:
            return int(obstore.head(self.client, key)["size"])
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as exc:
            self.fail("head", key, exc)

    def _get(self, key: str) -> Any:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return obstore.get(self.client, key)
        except (NotFoundError, FileNotFoundError):
            raise FileNotFoundError(f"{self.url_of(key)}: not found") from None
        except Exception as exc:
            self.fail("get", key, exc)

    def read_bytes(self, model: str, version: int, name: str) -> bytes:
        key = self.key(model, version, name)
        result = self._get(key)
        try:
            return bytes(result.bytes())
        except Exception as exc:
            self.fail("get", key, exc)

    def iter_bytes(self, model: str, version: int, name: str, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        key = self.key(model, version, name)
        result = self._get(key)
        try:
            for piece in result.stream(min_chunk_size=chunk):
                yield bytes(piece)
        except Exception as exc:
            self.fail("get", key, exc)

    def delete_version(self, model: str, version: int) -> bool:
        import obstore

        manifest = self.key(model, version, MANIFEST_NAME)
        if self.size(model, version, MANIFEST_NAME) is None:
            return False
        head = self.key(model, version)
        try:
            # The manifest first: from then on no reader sees the version.
            obstore.delete(self.client, manifest)
            keys = [m["path"] for batch in obstore.list(self.client, head, chunk_size=1000) for m in batch]
            if keys:
                obstore.delete(self.client, keys)
        except Exception as exc:
            self.fail("delete", head, exc)
        return True


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
