"""Who an exports directory belongs to: ``<exports-dir>/owner.json``.

An exports root holds one cluster's models (``<root>/<model>/<version>``):
its shard 0 restores from them, prunes them and cuts versions numbered after
them, and its API lists them. Two clusters on one root would do all of that
to each other's versions. So the root names its owner, and shard 0 (or
`ctrps demo`'s exporter) claims the root before it restores or exports
anything (`claim_exports`): an unowned root becomes its claimant's; the
owner's own claim (a restart) passes; another owner's is refused
(`ExportsOwnedError`, exit code 4) unless it takes the root over, which is
recorded in the file (``taken_from``).

An owner is a string: ``ctrps cluster`` and ``ctrps demo`` claim as their
run (the run's own directory's name, ``cluster-<time>-<random>``); a cluster
on an outside Kafka as its stream (`stream_owner`: the Kafka cluster id and
consumer group its exports' offsets belong to, so its next run resumes
there); a hand-started shard 0 as ``--exports-owner`` says, else
`HAND_STARTED`; `ps_core.Learner.save` as `LEARNER`. A root written before owner records existed is unowned.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from ..errors import ExportCorruptError, PSError
from .export_files import DEFAULT_FILE_MODE, dir_mode
from .exportstore import S3ExportStore, store_for
from .stream import StreamIdentity

__all__ = [
    "OWNER_FILE",
    "HAND_STARTED",
    "LEARNER",
    "ExportsOwner",
    "ExportsOwnedError",
    "read_owner",
    "claim_exports",
    "stream_owner",
    "run_exports_dir",
]

OWNER_FILE = "owner.json"
"""The owner record at an exports root."""

HAND_STARTED = "hand-started"
"""The owner a shard 0 claims as when ``--exports-owner`` names none: every
hand-started pipeline on the root (their streams are told apart by the
manifests' `StreamIdentity`, checked by the workers at a restore)."""


LEARNER = "learner"
"""The owner `ps_core.Learner.save` claims a root as (every Learner's)."""


class ExportsOwnedError(PSError, code="exports_owned", status=409):
    """The exports directory belongs to another cluster: refused to restore
    from it or export into it (exit code 4: refused to resume)."""

    exit_code = 4


@dataclass(frozen=True)
class ExportsOwner:
    """An exports root's owner record."""

    owner: str
    """Who the root belongs to (see the module's docstring)."""
    by: str
    """The command that claimed it (``ctrps shard``, ``ctrps cluster``, ``ctrps demo``)."""
    since: str
    """When it was claimed, ISO 8601 UTC."""
    host: str
    pid: int
    """The process that claimed it last (its owner's restarts claim it again)."""
    taken_from: str | None = None
    """The owner this one took the root over from (None: it was unowned)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, as `owner.json` holds it."""
        return {
            "owner": self.owner,
            "by": self.by,
            "since": self.since,
            "host": self.host,
            "pid": self.pid,
            "taken_from": self.taken_from,
        }

    def describe(self) -> str:
        """``cluster-... (ctrps cluster, pid 12 on host, since ...)``: for one-line messages."""
        return f"{self.owner!r} ({self.by}, pid {self.pid} on {self.host}, since {self.since})"


def stream_owner(stream: StreamIdentity) -> str:
    """The owner of a cluster's exports on an outside Kafka: its stream,
    ``kafka <cluster id> group <group>`` (the same on every run)."""
    return f"kafka {stream.cluster_id} group {stream.group}"


def read_owner(root: Path) -> ExportsOwner | None:
    """The root's owner record; None when it has none. `ExportCorruptError`
    naming the file when it does not read as one."""
    path = Path(root) / OWNER_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return _parse(data, str(path))


def _parse(data: bytes, path: str) -> ExportsOwner:
    """An owner record's bytes, read from `path` (`ExportCorruptError` naming it)."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ExportCorruptError(f"{path}: not JSON ({exc})", file=str(path), expected="JSON", actual="other") from None
    fields = {"owner": str, "by": str, "since": str, "host": str, "pid": int}
    if not isinstance(raw, dict) or any(not isinstance(raw.get(k), t) for k, t in fields.items()):
        raise ExportCorruptError(
            f"{path}: not an owner record (owner, by, since, host, pid)",
            file=str(path),
            expected="an owner record",
            actual="other",
        )
    taken = raw.get("taken_from")
    return ExportsOwner(
        raw["owner"], raw["by"], raw["since"], raw["host"], raw["pid"], taken if isinstance(taken, str) else None
    )


def _write(root: Path, record: ExportsOwner, file_mode: int, *, replace: bool) -> bool:
    """Write the record whole (a temporary file, fsynced, then linked or
    renamed into place). Without `replace` it appears only where there is no
    record (False: another claim came first)."""
    tmp = root / f".owner-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_record_bytes(record))
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, root / OWNER_FILE)
            return True
        try:
            os.link(tmp, root / OWNER_FILE)  # atomic, and never over another claim
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _record_bytes(record: ExportsOwner) -> bytes:
    return orjson.dumps(record.to_dict(), option=orjson.OPT_INDENT_2) + b"\n"


def _bucket_record(bucket: S3ExportStore) -> Callable[[], ExportsOwner | None]:
    """The reader of a bucket's owner record (``<prefix>/owner.json``)."""

    def read() -> ExportsOwner | None:
        data = bucket.read_object(OWNER_FILE)
        return None if data is None else _parse(data, bucket.url_of(OWNER_FILE))

    return read


def claim_exports(
    root: Path | str, owner: str, by: str, *, take_over: bool = False, file_mode: int = DEFAULT_FILE_MODE
) -> tuple[ExportsOwner, bool]:
    """Make the exports `root` `owner`'s, before anything is restored from
    it or exported into it; returns the record now there, and whether this
    claim took it over from another owner.

    Creates the root (``dir_mode(file_mode)``) when missing. An unowned root
    is claimed; one `owner` holds already names this process from now on
    (``by``, ``since`` and ``taken_from`` kept); one of another
    owner raises `ExportsOwnedError` (one line naming both and what to do)
    unless `take_over`, which replaces the record (``taken_from``). Two
    claims of an unowned root at once: one wins, the other sees its record.
    An ``s3://bucket/prefix`` root is claimed the same way through its
    ``<prefix>/owner.json`` object (a create-only PUT for a new record)."""
    read: Callable[[], ExportsOwner | None]
    write: Callable[[ExportsOwner, bool], bool]
    store = store_for(root) if "://" in str(root) else None
    if isinstance(store, S3ExportStore):
        bucket, where = store, f"exports {store.url}"
        read = _bucket_record(bucket)

        def write(record: ExportsOwner, replace: bool) -> bool:
            return bucket.write_object(OWNER_FILE, _record_bytes(record), replace=replace)
    else:
        local = Path(root)
        local.mkdir(mode=dir_mode(file_mode), parents=True, exist_ok=True)
        where = f"exports directory {local}"

        def read() -> ExportsOwner | None:
            return read_owner(local)

        def write(record: ExportsOwner, replace: bool) -> bool:
            return _write(local, record, file_mode, replace=replace)

    mine = ExportsOwner(owner, by, datetime.now(UTC).isoformat(timespec="seconds"), socket.gethostname(), os.getpid())
    for _ in range(2):  # a record may appear between the read and the write, once
        held = read()
        if held is not None and held.owner == owner:
            # Its owner again (a restart): the record names the process that runs now.
            again = ExportsOwner(owner, held.by, held.since, mine.host, mine.pid, held.taken_from)
            if again != held:
                write(again, True)
            return again, False
        if held is not None and not take_over:
            raise ExportsOwnedError(
                f"{where} belongs to {held.describe()}, not to {owner!r}: "
                "give this cluster another --exports-dir, or take this one over with --take-over-exports"
            )
        if held is not None:
            record = ExportsOwner(mine.owner, mine.by, mine.since, mine.host, mine.pid, held.owner)
            write(record, True)
            return record, True
        if write(mine, False):
            return mine, False
    raise ExportsOwnedError(f"{where}: its owner record keeps changing; claimed meanwhile")


def run_exports_dir(parent: Path, prefix: str) -> Path:
    """A directory of one run's own under `parent`, created now (never one
    that exists): ``<prefix>-<UTC time>-<random>``."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    while True:
        path = Path(parent) / f"{prefix}-{stamp}-{secrets.token_hex(3)}"
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            continue  # the same second and the same 24 random bits: draw again
        return path
