"""Export versions in an S3 bucket under a prefix, through obstore (the
``s3`` extra, imported when a store is made)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from ..manifest import MANIFEST_NAME, check_model_name, parse_version_dir, version_dir_name
from .aws_profile import profile_settings
from .base import READ_CHUNK, BinaryWriter, ExportStore, ExportStoreError, VersionUpload

if TYPE_CHECKING:
    from obstore.store import S3Store


def _one_line(exc: BaseException) -> str:
    """An exception as one line (obstore's are multi-line, with the whole
    chain of causes, then a "Debug source:" dump of the same): its type and
    its whitespace-collapsed text, without the dump."""
    text = str(exc).split("Debug source:", 1)[0]
    return f"{type(exc).__name__}: {' '.join(text.split())}"


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible server. Credentials are not here: they
    come from the AWS environment, else the profile's shared files
    (`profile_settings`), else web identity, container or instance
    credentials."""

    endpoint: str | None = None
    """The server's URL (MinIO, a test server); default ``AWS_ENDPOINT_URL``,
    else AWS's own. Plain ``http://`` is allowed for an explicit endpoint."""
    region: str | None = None
    """Default ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the profile's, else us-east-1."""
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
    through obstore (the ``s3`` extra).

    Only the manifest is create-only: two writers of one version at once
    (which one exporter never is) would share its data files' keys, and the
    loser's files could replace the winner's, which the manifest's SHA-256s
    then report as corrupt. Data files of an upload cut short stay, unlisted,
    until the version is written again or deleted."""

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
        # The shared files' keys and region, where the environment has none (obstore reads no file).
        config: dict[str, Any] = profile_settings(os.environ)
        if endpoint:
            config["endpoint"] = endpoint
        region = opts.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        config["region"] = region or config.get("region") or "us-east-1"
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
        return self.object_size(self.key(model, version, name))

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

    def drop_unlisted(self, model: str, below: int) -> list[int]:
        """Remove the objects of versions numbered below `below` that have no
        manifest (uploads cut short by a crash: the exporter's numbers only
        grow, so none of them is ever completed); returns those versions."""
        import obstore

        head = f"{check_model_name(model)}/"
        by_version: dict[int, list[str]] = {}
        try:
            for batch in obstore.list(self.client, head, chunk_size=1000):
                for meta in batch:
                    parts = meta["path"][len(head) :].split("/")
                    v = parse_version_dir(parts[0])
                    if len(parts) == 2 and v is not None and v < below and parts[0] == version_dir_name(v):
                        by_version.setdefault(v, []).append(meta["path"])
            orphans = {v: ks for v, ks in by_version.items() if self.key(model, v, MANIFEST_NAME) not in ks}
            for keys in orphans.values():
                obstore.delete(self.client, keys)
        except Exception as exc:
            self.fail("delete", head, exc)
        return sorted(orphans)

    def read_object(self, key: str) -> bytes | None:
        """An object of the root (its key under the prefix, e.g. ``owner.json``);
        None when there is none."""
        try:
            return bytes(self._get(key).bytes())
        except FileNotFoundError:
            return None
        except ExportStoreError:
            raise
        except Exception as exc:
            self.fail("get", key, exc)

    def write_object(self, key: str, data: bytes, *, replace: bool) -> bool:
        """Write an object of the root whole; without `replace` only where there
        is none (a create-only PUT: False when one is there)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self.client, key, data, mode="overwrite" if replace else "create")
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            return False
        except Exception as exc:
            self.fail("put", key, exc)
        return True

    def object_size(self, key: str) -> int | None:
        """An object of the root's size in bytes (its key under the prefix);
        None when there is none."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return int(obstore.head(self.client, key)["size"])
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as exc:
            self.fail("head", key, exc)

    def delete_object(self, key: str) -> None:
        """Delete an object of the root (none there: no change)."""
        import obstore

        try:
            obstore.delete(self.client, key)
        except FileNotFoundError:
            return
        except Exception as exc:
            self.fail("delete", key, exc)

    def top_level(self) -> list[str]:
        import obstore

        try:
            found = obstore.list_with_delimiter(self.client, None)
        except Exception as exc:
            self.fail("list", "", exc)
        names = (p.rstrip("/").rpartition("/")[2] for p in found["common_prefixes"])
        return sorted(n for n in names if n and not n.startswith("."))

    def check_writable(self) -> None:
        """Write a probe object under the prefix and delete it: a bucket that
        cannot be reached or written is one `ExportStoreError` (within the
        store's timeouts) before anything depends on it."""
        import obstore

        key = f".write-check-{secrets.token_hex(6)}"
        self.write_object(key, b"", replace=True)
        try:
            obstore.delete(self.client, key)
        except Exception as exc:
            self.fail("delete", key, exc)

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
