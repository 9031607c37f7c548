"""A serving replica: a model's exports loaded into this process and kept
current as new versions appear (``ctrps serve --follow exports/<model>``).

`Follower` loads the newest chain of a model's export directory (its base,
then each delta) into read-only tables (`ReplicaTables`: sorted keys
searched vectorised, weights in the serving files' precision; a replica
holds the whole model, so keys need no routing), then polls the directory every
`Follower.interval_s` and applies each new delta, in order, every file's
SHA-256 checked before anything of the version is applied. A newer base (a
periodic base, or a compaction) is loaded into a fresh shard and swapped in
whole; so is the newest chain when a delta does not follow the served
version (a gap). A version that fails its checks is refused with one log
line naming the file and both checksums; the replica keeps serving what it
has and tries the version again at each poll, logging the same failure once.

The API reads the replica through `Follower.client`, a `PSReader` over one
`ReplicaTransport`: pulls answer from the served shard and report the served
export version. It has no write path at all: the API answers its mutating
routes with `ReadOnlyReplicaError` (409) itself. Before the first version is
loaded, reads are `NoVersionError` (503).

Files are read and hashed in a thread. A delta is applied to the served
shard, and a fresh shard swapped in, on the event loop in one synchronous
step, so each read sees one version or the next, never part of one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ps_core.checkpoint.export_files import (
    LoadedVersion,
    VersionInfo,
    latest_chain,
    list_versions,
    load_version,
    read_manifest,
    serves_weights,
    version_dirs,
)
from ps_core.checkpoint.exportstore import DirVersion, ExportStore, ExportStoreError, StoredModel, VersionSource
from ps_core.checkpoint.manifest import ExportManifest, is_model_name
from ps_core.checkpoint.manifest_model import model_from_manifest
from ps_core.checkpoint.registry import MODEL_FILE
from ps_core.errors import ExportCorruptError, ExportNotFoundError, PSError
from ps_core.hashing import U64
from ps_core.model.models import Model
from ps_core.net.client import PSReader
from ps_core.net.control_messages import BoardEntry
from ps_core.net.transports import Pulled
from ps_core.replica import ReplicaTables
from ps_core.store.storage import F32
from ps_core.store.table_config import TableConfig

from ..background import BackgroundLoop
from ..logs import log_event
from .errors import NoVersionError

__all__ = ["Follower", "ReplicaTransport", "model_from_manifest", "model_of_exports", "follow_dir"]

log = logging.getLogger("ctrps.follow")
_T = TypeVar("_T")

# What makes a version unusable rather than this code broken: damaged or
# vanished files (pruned or compacted while read), a manifest that does not
# fit the served model or chain, rows a table refuses.
_REFUSALS = (PSError, ValueError, OSError)
_MAX_LOGGED_FAILURES = 1024


Followed = Path | StoredModel
"""A model's exports a replica follows: a local directory, or a store's model
(``s3://bucket/prefix/<model>``, `ps_core.checkpoint.exportstore.model_at`)."""


def model_of_exports(model_dir: Followed, default: Model) -> Model:
    """The model of the newest version in `model_dir` whose manifest reads
    and names a model; `default` when there is none (the replica then waits
    for versions of `default`). `ExportStoreError` if a store does not answer."""
    for info in reversed(list_versions(model_dir)):
        try:
            return model_from_manifest(info.manifest)
        except ValueError:
            continue
    return default


def follow_dir(path: Path, model_name: str) -> Path:
    """The model directory to follow: `path` itself, or, when `path` holds
    no version but a directory `model_name`, that one (`path` is then an
    exports root, as ``ctrps shard --exports-dir`` fills it)."""
    nested = path / model_name
    if not version_dirs(path) and nested.is_dir():
        return nested
    return path


def followed_models(root: Path | ExportStore, default: str) -> dict[str, Followed]:
    """Every model under the exports `root` (``--follow-all``): the default
    model's first, then each directory holding a ``model.json`` or a version,
    by name. Hidden directories (a write in progress) are not models. Under a
    bucket's root, each name of its top level that is a model's."""
    if isinstance(root, ExportStore):
        stored: dict[str, Followed] = {default: StoredModel(root, default)}
        for name in root.top_level():
            if name not in stored and is_model_name(name):
                stored[name] = StoredModel(root, name)
        return stored
    out: dict[str, Followed] = {default: follow_dir(root, default)}
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir(), key=lambda p: p.name):
        if d.name.startswith(".") or not d.is_dir() or d.name in out:
            continue
        if (d / MODEL_FILE).is_file() or version_dirs(d):
            out[d.name] = d
    return out


def _describe(model: Model) -> str:
    return f"{type(model).__name__} {model.name!r} (tables {', '.join(model.table_names)})"


class ReplicaTransport:
    """The served shard of a replica, as the API's only transport: a
    `ShardReader`, with no write path at all.

    `Follower` swaps `shard` whole when a new base loads and sets `version`
    with it; reads use the shard in place at the time of the call. Pulls
    report the served export version (the weights are exactly that
    version's), and reads before the first version are `NoVersionError`."""

    shard_id = 0

    def __init__(self, source: Followed) -> None:
        self.shard = ReplicaTables()
        self.declared: Mapping[str, TableConfig] = {}
        """The served version's tables as the trainers declared them (the
        shard holds their weights only, when the version has serving files)."""
        self.source = source
        """The exports followed (named in errors)."""
        self.version: int | None = None
        """The export version `shard` holds; None until one is loaded."""

    def _served(self) -> tuple[ReplicaTables, int]:
        if self.version is None:
            raise NoVersionError(f"no export version loaded yet from {self.source}")
        return self.shard, self.version

    async def pull(self, table: str, keys: U64) -> F32:
        return self._served()[0].handle_pull(table, keys)[0]

    key_sets = False  # a replica keeps nothing for pushes: it has none

    async def pull_versioned(self, table: str, keys: U64, presence: bool, remember: int = 0) -> Pulled:
        shard, version = self._served()
        weights = shard.handle_pull(table, keys)[0]
        return Pulled(weights, version, shard.contains(table, keys) if presence else None)

    async def close(self) -> None:
        return None


class ReplicaView:
    """What the API observes of a replica: its one shard's stats (tables at
    the served version) and an empty status board (no worker reports here)."""

    num_shards = 1

    def __init__(self, transport: ReplicaTransport) -> None:
        self._transport = transport

    async def stats_each(self) -> list[dict[str, Any] | PSError]:
        stats = self._transport.shard.stats()
        # A table's open version would read one above the export it holds.
        for name, table in stats["tables"].items():
            table["version"] = self._transport.version
            declared = self._transport.declared.get(name)
            if declared is not None:  # the trainers' declaration, not the weights-only one held
                table["config"] = declared.to_dict()
        return [stats]

    async def statuses(self) -> list[BoardEntry]:
        return []


class Follower(BackgroundLoop):
    """Serves a model's export directory and follows it.

    ``async with Follower(model_dir, model) as follower`` starts the polling
    task (the first poll loads the newest chain) and stops it; `poll` is one
    look at the directory and may be awaited directly. The API reads through
    `client`; `info` is what ``GET /v1/model`` adds about the replica.
    """

    task_name = "ctrps-follower"

    def __init__(self, model_dir: Path | str | StoredModel, model: Model, *, interval_s: float = 1.0) -> None:
        """`model` is what the replica serves: versions holding another
        model's tables are refused (see `model_of_exports`). A local
        `model_dir` may be an exports root: until a version is served, each
        poll looks for ``<model.name>/`` in it (`follow_dir`), which may
        appear later. A `StoredModel` is that model's versions in a store."""
        if not 0 < interval_s < float("inf"):
            raise ValueError("the poll interval must be a positive number of seconds")
        self.path: Followed = model_dir if isinstance(model_dir, StoredModel) else Path(model_dir)
        """The exports given."""
        self.model_dir: Followed = self.path
        """The model's exports followed: `path`, or its ``<model.name>/``."""
        self.model = model
        self.interval_s = interval_s
        self.transport = ReplicaTransport(self.model_dir)
        self.client = PSReader([self.transport])
        """A reader of the served shard: what the API pulls from."""
        self.view = ReplicaView(self.transport)
        """What the API observes of the replica (stats, no board)."""
        self._served: ExportManifest | None = None
        self._weights = False
        """Whether the served shard holds weights only (serving files)."""
        self._base_version: int | None = None
        self._lock = asyncio.Lock()
        # Failures already logged (by detail), oldest first: a version that
        # stays damaged is refused at every poll but logged once.
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._errors: list[tuple[int | None, str]] = []
        # Refused versions with their files' signature then: tried again only
        # once the files change.
        self._refused: dict[int, tuple[tuple[tuple[str, int, int], ...], Exception]] = {}
        self.error: str | None = None
        """Why the last poll refused a version (or found none), else None."""
        self.newest_version: int | None = None
        """The newest version directory seen at the last poll."""
        self.last_poll_at: float | None = None
        """When the last poll ended (seconds since the epoch)."""
        self.loaded_at: float | None = None
        """When the served version was applied or swapped in."""
        self.last_load_ms: float | None = None
        """Reading and hashing the last version applied (in a thread)."""
        self.last_apply_ms: float | None = None
        """The event loop's time applying the last delta, or swapping a shard in."""
        self.deltas_applied = 0
        """Deltas applied to the served shard."""
        self.bases_loaded = 0
        """Chains loaded into a fresh shard and swapped in."""
        self.read_failures = 0
        """Reads that failed: a version refused, or the store not answering (one a poll)."""
        self._outage: tuple[float, str] | None = None
        """Since when (monotonic) and why the store has not answered, while it does not."""

    @property
    def served_version(self) -> int | None:
        """The export version served; None until one is loaded."""
        return self.transport.version

    # -- lifecycle (start/stop: BackgroundLoop) ---------------------------------------
    def check_ready(self) -> None:
        """Raise unless a version is served: `NoVersionError`, or what ended
        the polling task if it failed."""
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            error = task.exception()
            if error is not None:
                raise RuntimeError(f"the export follower stopped: {error!r}") from error
        if self._served is None:
            detail = f" ({self.error})" if self.error else ""
            raise NoVersionError(f"no export version loaded yet from {self.model_dir}{detail}")

    def info(self) -> dict[str, Any]:
        """``last_export_version``, ``served_version`` and ``follow`` for ``GET /v1/model``."""
        served = self._served
        return {
            "last_export_version": self.served_version,
            "served_version": self.served_version,
            "precision": self.transport.shard.precision,
            "follow": {
                "dir": str(self.model_dir),
                "interval_s": self.interval_s,
                "base_version": self._base_version,
                "newest_version": self.newest_version,
                "created_at": None if served is None else served.created_at.isoformat(),
                "loaded_at": self.loaded_at,
                "last_poll_at": self.last_poll_at,
                "last_load_ms": self.last_load_ms,
                "last_apply_ms": self.last_apply_ms,
                "deltas_applied": self.deltas_applied,
                "bases_loaded": self.bases_loaded,
                "read_failures": self.read_failures,
                "error": self.error,
            },
        }

    def versions(self) -> list[VersionInfo]:
        """The versions followed, oldest first (none while a local directory
        does not exist); `NoVersionError` (503) when the store does not answer.
        Blocking: run it in a thread."""
        if isinstance(self.model_dir, Path):
            return list_versions(self.model_dir) if self.model_dir.is_dir() else []
        try:
            return list_versions(self.model_dir)
        except ExportStoreError as exc:
            raise NoVersionError(f"the export store does not answer: {exc}") from None

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:
                log.exception("export follower failed", extra={"fields": {"dir": str(self.model_dir)}})
                raise
            await asyncio.sleep(self.interval_s)

    # -- one poll --------------------------------------------------------------------
    async def poll(self) -> bool:
        """Look at the directory once and serve what is new there: the deltas
        after the served version, in order, or the newest chain (at start, on
        a newer base or a gap). True when the served version changed."""
        async with self._lock:
            before = self.served_version
            self._errors = []
            if before is None and isinstance(self.path, Path):
                self.model_dir = await asyncio.to_thread(follow_dir, self.path, self.model.name)
                self.transport.source = self.model_dir
            try:
                dirs = await asyncio.to_thread(self._listing)
                self.newest_version = max(dirs, default=None)
                served = self.served_version
                if served is None or await self._apply_new_deltas(dirs, served):
                    await self._reload()
            except ExportStoreError as exc:  # the store did not answer: what is served stays
                self._unreachable(exc)
            else:
                self._reachable()
            served = self.served_version
            # A refusal of a version older than the one now served is moot.
            self.error = (
                "; ".join(detail for v, detail in self._errors if v is None or served is None or v > served) or None
            )
            for v in [v for v in self._refused if served is not None and v <= served]:
                del self._refused[v]
            self.last_poll_at = time.time()
            return served != before

    def _listing(self) -> dict[int, VersionSource]:
        """The visible versions followed (a store's: those with a manifest)."""
        if isinstance(self.model_dir, StoredModel):
            return self.model_dir.versions()
        return {v: DirVersion(p) for v, p in version_dirs(self.model_dir).items()}

    async def _apply_new_deltas(self, dirs: Mapping[int, VersionSource], served: int) -> bool:
        """Apply each delta after version `served`, in order, up to the first
        refused; True when a base or a gap calls for a reload."""
        for version in sorted(v for v in dirs if v > served):
            path = dirs[version]
            t0 = time.perf_counter()
            try:
                got = await asyncio.to_thread(self._attempt, version, path, self._read_delta, path, served)
                if isinstance(got, ExportManifest):
                    if got.kind == "delta":
                        self._note(
                            f"version {version} follows {got.parent}, not the served version "
                            f"{served}: loading the newest chain"
                        )
                    return True
                # Checked and merged beside the served tables, in a thread (a
                # merge touches every row held): a refusal leaves them as they were.
                tables = self.transport.shard
                staged = await asyncio.to_thread(tables.stage, got, serving=self._weights)
                load_ms = (time.perf_counter() - t0) * 1000
                t1 = time.perf_counter()
                tables.install(staged)
            except ExportStoreError:
                raise  # not the version's fault: the poll reports the store
            except _REFUSALS as exc:
                self._refuse(version, exc)
                return await asyncio.to_thread(self._base_after, dirs, version)
            self._serve(tables, got.manifest, "delta applied", load_ms, t1)
            self.deltas_applied += 1
            served = version
        return False

    def _attempt(self, version: int, path: VersionSource, read: Callable[..., _T], *args: Any) -> _T:
        """``read(*args)`` of a version, unless it was refused before and its
        files have not changed since: then that refusal again, without
        reading (a damaged base is not hashed again at every poll). Runs in
        a thread, under the poll's lock."""
        signature = _signature(path)
        known = self._refused.get(version)
        if known is not None and known[0] == signature:
            raise known[1]
        try:
            return read(*args)
        except (PSError, ValueError) as exc:
            # OSError is not remembered: a read that failed may succeed as is.
            self._refused[version] = (signature, exc)
            raise

    @staticmethod
    def _base_after(dirs: Mapping[int, VersionSource], refused: int) -> bool:
        """Whether a base newer than the refused version is there: then the
        replica moves on to it instead of waiting for the refused one."""
        for version in sorted((v for v in dirs if v > refused), reverse=True):
            try:
                if read_manifest(dirs[version]).kind == "base":
                    return True
            except _REFUSALS:
                continue
        return False

    def _read_delta(self, path: VersionSource, parent: int) -> LoadedVersion | ExportManifest:
        """The delta at `path`, read and hashed, if it is one of `parent`;
        else its manifest (a base, or a delta of another parent)."""
        manifest = read_manifest(path)
        # A delta in the other form than the served shard's (weights only or
        # whole rows) cannot apply to it: the newest chain is loaded instead.
        # So is a delta in another serving precision than the served one's.
        if (
            manifest.kind != "delta"
            or manifest.parent != parent
            or serves_weights(manifest) != self._weights
            or (self._weights and manifest.serving_precision != self.transport.shard.precision)
        ):
            return manifest
        self._check_model(manifest)
        loaded = load_version(path, verify=True, serving=self._weights)
        # Compacted into a base since its manifest was read: reload instead.
        if loaded.manifest.kind != "delta" or loaded.manifest.parent != parent:
            return loaded.manifest
        return loaded

    async def _reload(self) -> None:
        """Load the newest complete chain into a fresh shard and swap it in
        if it is newer than what is served."""
        try:
            chain, failure = await asyncio.to_thread(self._newest_chain)
        except ExportNotFoundError as exc:
            self._errors.append((None, exc.detail))
            self._note(f"waiting for an export: {exc.detail}")
            return
        if failure is not None:
            self._refuse(None, failure)
        served = self.served_version
        if served is not None and chain[-1].version <= served:
            return
        t0 = time.perf_counter()
        shard, manifest, refused = await asyncio.to_thread(self._build, chain)
        if refused is not None:
            self._refuse(*refused)
        if manifest is None or (served is not None and manifest.version <= served):
            return
        self._serve(shard, manifest, "chain loaded", (time.perf_counter() - t0) * 1000, time.perf_counter())
        self._base_version = chain[0].version
        self.bases_loaded += 1

    def _newest_chain(self) -> tuple[list[VersionInfo], ExportCorruptError | None]:
        """The newest complete chain (files present, sizes right), and why
        the newest version could not end it, if so. Runs in a thread."""
        try:
            return latest_chain(self.model_dir, serving=True), None
        except ExportCorruptError as exc:
            return latest_chain(self.model_dir, fallback=True, serving=True), exc

    def _build(
        self, chain: list[VersionInfo]
    ) -> tuple[ReplicaTables, ExportManifest | None, tuple[int, Exception] | None]:
        """Fresh tables holding as much of `chain` as passes its checks: the
        tables, the last version applied (None: not even the base) and the
        refused version with why. Runs in a thread: the tables are nobody
        else's until they are swapped in."""
        # Weights only when every version has them (all but versions written
        # before serving files existed): no optimizer state to read or hold,
        # in the precision of the newest version's serving files (older ones
        # of another precision are read as float32 and held in it).
        serving = all(serves_weights(info.manifest) for info in chain)
        tables = ReplicaTables(chain[-1].manifest.serving_precision if serving else "f32")
        applied: ExportManifest | None = None
        for info in chain:
            try:
                self._attempt(info.version, info.source, self._load_into, tables, info, serving)
            except ExportStoreError:
                raise  # not the version's fault: the poll reports the store
            except _REFUSALS as exc:
                return tables, applied, (info.version, exc)
            applied = info.manifest
        return tables, applied, None

    def _load_into(self, tables: ReplicaTables, info: VersionInfo, serving: bool) -> None:
        self._check_model(info.manifest)
        tables.apply(load_version(info.source, verify=True, serving=serving), serving=serving)

    def _check_model(self, manifest: ExportManifest) -> None:
        got = model_from_manifest(manifest)
        if got.table_names != self.model.table_names:
            raise ValueError(
                f"version {manifest.version} holds {_describe(got)}; this replica serves "
                f"{_describe(self.model)}: restart it to serve the other model"
            )

    def _serve(self, tables: ReplicaTables, manifest: ExportManifest, how: str, load_ms: float, t_apply: float) -> None:
        """Make `tables`, holding `manifest`'s version, the served ones: one
        synchronous step, so no read sees the tables and version disagree."""
        self.transport.shard = tables
        self.transport.version = manifest.version
        self.transport.declared = manifest.tables
        self._served = manifest
        self._weights = serves_weights(manifest)
        self.loaded_at = time.time()
        self.last_load_ms = round(load_ms, 3)
        self.last_apply_ms = round((time.perf_counter() - t_apply) * 1000, 3)
        log_event(
            log,
            f"serving export version: {how}",
            version=manifest.version,
            kind=manifest.kind,
            parent=manifest.parent,
            rows=manifest.rows(),
            deleted=manifest.deleted(),
            load_ms=self.last_load_ms,
            apply_ms=self.last_apply_ms,
        )

    # -- logging once ----------------------------------------------------------------
    def _once(self, detail: str) -> bool:
        """Whether `detail` is new (and remember it)."""
        if detail in self._logged:
            return False
        self._logged[detail] = None
        if len(self._logged) > _MAX_LOGGED_FAILURES:
            self._logged.popitem(last=False)
        return True

    def _refuse(self, version: int | None, exc: Exception) -> None:
        """A version failed its checks: one warning per distinct failure."""
        self.read_failures += 1
        detail = exc.detail if isinstance(exc, PSError) else f"{type(exc).__name__}: {exc}"
        self._errors.append((version, detail if version is None else f"version {version}: {detail}"))
        if not self._once(detail):
            return
        fields: dict[str, Any] = {"dir": str(self.model_dir), "version": version, "serving": self.served_version}
        if isinstance(exc, ExportCorruptError):
            fields.update(file=exc.file, expected=exc.expected, actual=exc.actual)
        fields["detail"] = detail
        log.warning("export version refused", extra={"fields": fields})

    def _unreachable(self, exc: ExportStoreError) -> None:
        """The store did not answer this poll: counted, and one warning an
        outage (its first cause); the served version stays served."""
        self.read_failures += 1
        self._errors.append((None, str(exc)))
        if self._outage is None:
            self._outage = (time.monotonic(), str(exc))
            fields = {"dir": str(self.model_dir), "serving": self.served_version, "error": str(exc)}
            log.warning("export store unreachable: serving the last version", extra={"fields": fields})

    def _reachable(self) -> None:
        """The store answered a whole poll: an outage ends, with its duration."""
        if self._outage is not None:
            since, cause = self._outage
            self._outage = None
            down_s = round(time.monotonic() - since, 3)
            log_event(log, "export store reachable again", dir=str(self.model_dir), down_s=down_s, cause=cause)

    def _note(self, message: str) -> None:
        """An expected condition (no export yet, a gap), logged once at INFO."""
        if self._once(message):
            log_event(log, message, dir=str(self.model_dir), serving=self.served_version)


def _signature(source: VersionSource) -> tuple[tuple[str, int, int], ...]:
    """What changes when a version directory's files are rewritten: each
    file's name, size and modification time (empty if it cannot be listed).
    A store's version is empty: its manifest is written once, so a version
    refused there stays refused (a newer base moves the replica past it)."""
    if not isinstance(source, DirVersion):
        return ()
    try:
        entries = list(os.scandir(source.path))
        return tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in entries for st in (e.stat(),)))
    except OSError:
        return ()
