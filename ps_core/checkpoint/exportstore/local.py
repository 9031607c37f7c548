"""Export versions in a local directory: the on-disk layout as it has always
been (a hidden ``.tmp-`` directory, fsynced, renamed into place)."""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..manifest import MANIFEST_NAME, check_model_name, parse_version_dir, version_dir_name
from .base import READ_CHUNK, ExportStore, VersionUpload


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

    def top_level(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

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
