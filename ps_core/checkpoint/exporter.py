"""Export cuts of the shards into ``<root>/<model>/``, one directory per model.

`Exporter.cut` runs one export: the coordinator's pause (wait for leased
windows, every shard copies its rows: `Shard.take_snapshot`), then, with
leases granted again, it fetches the copies from the shards and writes the
version (`ps_core.checkpoint.export_files.write_version`, in a thread) and prunes old ones.

The exporter runs where the coordinator runs (shard 0, or ``ctrps demo``)
and reaches every shard through a `ControlClient`, so shards need no shared
storage: only the exporter writes files.

A cut is one moment of every model of the cluster (`ps_core.checkpoint.registry`):
each model's tables go to its own directory, under the cut's version, with
that model's offsets. So the models share one version sequence and every
model's directory holds every version cut since the model was created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import msgspec

from ..errors import (
    ClusterNotReadyError,
    CutAbortedError,
    CutNotJoinedError,
    ExportWriteError,
    InvalidRequestError,
    ModelConflictError,
    NoCommonVersionError,
    PSError,
    ShardUnavailableError,
    SnapshotError,
    UnknownModelError,
)
from ..net.control_messages import (
    Compaction,
    ExportList,
    ExportReportBody,
    ModelDeclaration,
    ModelEntry,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
    VersionEntry,
)
from ..slots import SlotMap
from ..waits import within
from .control import ControlClient
from .coordinator import Coordinator, Cut
from .cut_failure import CutFailed, DeltaRefused, describe_failure
from .export_files import DEFAULT_FILE_MODE, bucket_of, model_at, remove_version, versions_at, write_model_version
from .export_report import ExportReport
from .exportstore import StoredModel
from .manifest import check_model_name, version_dir_name
from .registry import ModelRegistry, ModelSpec
from .retention import compact, prune, prune_at

__all__ = ["Exporter"]

log = logging.getLogger("ctrps.export")


class Exporter:
    """Cuts and writes versions of one model; one cut at a time."""

    def __init__(
        self,
        coordinator: Coordinator,
        client: ControlClient,
        root: Path | str,
        model: str,
        *,
        keep_bases: int = 2,
        cut_timeout_s: float = 30.0,
        abort_timeout_s: float = 10.0,
        serving_precision: str = "f32",
        registry: ModelRegistry | None = None,
        file_mode: int = DEFAULT_FILE_MODE,
    ) -> None:
        """`cut_timeout_s` bounds each shard's copy (in the pause) and each
        fetch; `abort_timeout_s` each shard's drop of an aborted cut;
        `serving_precision`, what the serving files hold the weights in;
        `registry`, the cluster's models (default: those declared under
        `root`, with `model` the default one); `file_mode`, the mode of the
        files written (their directories get ``x`` wherever ``r``)."""
        self.coordinator = coordinator
        self.serving_precision = serving_precision
        self.file_mode = file_mode
        self.cut_timeout_s = cut_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.exports = 0
        """Versions written."""
        self.failures: dict[str, int] = {}
        """Failed cuts and writes by reason: ``unreachable``, ``timeout``,
        ``refused``, ``not_joined``, ``error`` (a shard's copy), ``fetch``, ``disk`` (any
        `OSError` writing), ``prune``, ``not_ready`` (a periodic export
        skipped while shards join or restore)."""
        self.client = client
        self.model = check_model_name(model)
        coordinator.set_default(self.model)
        self.store = bucket_of(root)
        """The bucket versions go to (an ``s3://bucket/prefix`` `root`, each
        model under ``<prefix>/<model>/``); None: the local directory `root`."""
        # With a bucket nothing is written under `root` (every path goes
        # through `_at`); it stays a Path for the local case's callers.
        self.root = Path(root) if self.store is None else Path()
        if registry is None:
            registry = ModelRegistry.load(self.root if self.store is None else self.store, self.model)
        self.registry = registry
        self._registry_changes = self.registry.changes
        self.keep_bases = keep_bases
        self._lock = asyncio.Lock()
        # Set when a cut paused but its files were not written: the shards
        # moved on, so only a base can follow.
        self._need_base = False
        self.last: ExportReport | None = None
        """The latest export written."""
        self.interval_s = 0.0
        """Seconds between periodic exports (`run`'s); 0: only when asked."""
        # Monotonic: the age of the last export must not jump with the wall clock.
        self._last_at = time.monotonic()

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every cut and compaction (which rewrite the directory)."""
        return self._lock

    @property
    def model_dir(self) -> Path:
        """``<root>/<model>``: the default model's directory (a local root's)."""
        if self.store is not None:
            raise ValueError(f"exports on {self.store.url} have no local directory")
        return self.root / self.model

    def _at(self, name: str) -> Path | StoredModel:
        """Model `name`'s versions: its directory, or its model in the bucket."""
        return model_at(self.root, self.store, name)

    def dir_of(self, model: str | None = None) -> Path | StoredModel:
        """``<root>/<model>`` or the bucket's model (None: the default model);
        `UnknownModelError` for a model the cluster does not hold."""
        name = model or self.model
        self.registry.check(name)
        return self._at(name)

    async def cut(self, kind: str | None = None) -> ExportReport:
        """Cut, then write; `kind` forces ``base`` or ``delta`` (default: the
        coordinator's schedule, a base after a failed cut or write).

        A cut that fails on any shard is aborted on every shard
        (`CutAbortedError`); files that cannot be written are
        `ExportWriteError` naming the path. Either way: one WARNING line, a
        count in `failures`, no partial version, and the next cut is a base.
        A delta refused by a shard (its tables were cut since the parent,
        e.g. by a stray snapshot request) is retried at once as a base.
        """
        async with self._lock:
            try:
                return await self._cut(kind)
            except DeltaRefused:
                return await self._cut("base")

    async def _cut(self, kind: str | None) -> ExportReport:
        # A model created since the last cut starts its directory with a base.
        if self._need_base or not self._chain_is_whole() or self.registry.changes != self._registry_changes:
            kind = "base"
        self._registry_changes = self.registry.changes
        t0 = time.perf_counter()
        cut = await self._take_cut(kind, t0)
        self._need_base = True
        snaps = await self._fetch(cut, t0)
        written = await self._write(cut, snaps)
        pruned = await self._prune(cut.version, written)
        self._need_base = False
        self.exports += 1
        self._last_at = time.monotonic()
        self.coordinator.version = cut.version
        return self._report(cut, written, pruned, t0)

    async def _take_cut(self, kind: str | None, t0: float) -> Cut[int | None]:
        """The coordinator's cut (the pause and every shard's copy); a failed
        one is aborted on every shard (`CutAbortedError`, or `DeltaRefused` for a
        delta a shard refused) and the next cut is a base."""
        copying = t0  # when the copy step began, after the wait for leased windows

        async def snapshot(version: int, cut_kind: str) -> int | None:
            nonlocal copying
            copying = time.perf_counter()
            parent = self.coordinator.last_version if cut_kind == "delta" else None
            await self._snapshot_all(version, parent)
            return parent

        try:
            return await self.coordinator.cut(snapshot, kind)
        except CutFailed as failed:
            # Some shards may have cut and moved on: the next cut is a base.
            self._need_base = True
            await self._abort(failed, t0, copying)
            if failed.reason == "refused" and failed.kind == "delta":
                raise DeltaRefused() from None
            raise CutAbortedError(failed.detail(time.perf_counter() - t0)) from None
        except BaseException:
            self._need_base = True
            raise

    async def _fetch(self, cut: Cut[int | None], t0: float) -> dict[int, list[Any]]:
        """Every shard's copies of `cut`; a failed fetch aborts it (`CutAbortedError`)."""
        fetching = time.perf_counter()
        try:
            return await within(self.client.fetch_snapshots(cut.version), self.cut_timeout_s)
        except (PSError, TimeoutError) as exc:
            self.coordinator.spend(cut.version)
            by_shard: dict[int, BaseException] = {int(getattr(exc, "shard_id", -1)): exc}
            fetch = CutFailed(cut.version, cut.kind, "fetch", by_shard, self.cut_timeout_s)
            await self._abort(fetch, t0, fetching)
            raise CutAbortedError(fetch.detail(time.perf_counter() - t0)) from None

    async def _write(self, cut: Cut[int | None], snaps: dict[int, list[Any]]) -> dict[str, dict[str, Any]]:
        """Each model's files of `cut` (`_write_models`, in a thread);
        `ExportWriteError` naming the directory if they cannot be written."""
        # Shard 0's map, the coordinator's: this process's, no request.
        slot_map = await self.client.slot_map()
        try:
            return await asyncio.to_thread(self._write_models, cut, snaps, slot_map)
        except OSError as exc:
            # write_version leaves no partial directory behind (its temporary
            # one is removed), and _write_models removes the models' versions
            # written before the failure; the copies were handed over, so
            # nothing else holds the version: it is spent.
            self.coordinator.spend(cut.version)
            # The directory is what an operator frees or fixes; the file that
            # failed may be inside the (removed) hidden temporary one. A
            # bucket's error names the s3:// key and the cause itself.
            failed_dir = getattr(exc, "model_dir", self._at(self.model))
            where, failed_file = str(failed_dir), str(exc.filename or "-")
            why = exc.strerror or str(exc)
            detail = f"export version {cut.version} not written to {where}: {why} (at {failed_file})"
            self._failed("disk", version=cut.version, path=where, file=failed_file, error=why)
            raise ExportWriteError(detail, path=where) from None

    async def _prune(self, version: int, written: dict[str, dict[str, Any]]) -> list[int]:
        """Retention in each model directory written; the versions removed."""
        pruned: list[int] = []
        for name in written:
            try:
                pruned = sorted(set(pruned) | set(await asyncio.to_thread(prune_at, self._at(name), self.keep_bases)))
            except OSError as exc:
                # the version is written; retention runs again after the next one
                self._failed(
                    "prune",
                    version=version,
                    path=str(exc.filename or self._at(name)),
                    error=str(exc.strerror or exc),
                )
        return pruned

    def _report(
        self, cut: Cut[int | None], written: dict[str, dict[str, Any]], pruned: list[int], t0: float
    ) -> ExportReport:
        """The export's report (kept as `last`) and its log line."""
        path = f"{self._at(self.model)}/{version_dir_name(cut.version)}"
        default = written.get(self.model, {"path": path, "rows": 0, "bytes": 0})
        report = ExportReport(
            version=cut.version,
            kind=cut.kind,
            parent=cut.snapshot,
            path=str(default["path"]),
            rows=int(default["rows"]),
            bytes=int(default["bytes"]),
            offsets=cut.offsets,
            lease_wait_s=cut.lease_wait_s,
            pause_s=cut.pause_s,
            write_s=time.perf_counter() - t0 - cut.pause_s,
            expired_leases=cut.expired_leases,
            pruned=pruned,
            stream=cut.stream,
            models=written,
        )
        self.last = report
        log.info(
            "export",
            extra={
                "fields": {
                    **{k: v for k, v in report.to_dict().items() if k not in ("offsets", "path", "stream", "models")},
                    "models": ",".join(written) or "-",
                }
            },
        )
        return report

    def _write_models(self, cut: Any, snaps: dict[int, list[Any]], slot_map: SlotMap) -> dict[str, dict[str, Any]]:
        """Write each model's tables of `cut` into its directory; returns per
        model its path, rows and bytes. A model without tables yet writes
        nothing (but the default model). On an `OSError` the versions already written are removed
        (so no model holds the version) and the error carries ``model_dir``.
        Synchronous: run in a thread."""
        by_model = self.registry.split({s.table for shard in snaps.values() for s in shard})
        written: dict[str, dict[str, Any]] = {}
        for name, tables in by_model.items():
            if not tables and name != self.model:
                continue  # the default model is written even empty, as it always was
            mine = set(tables)
            part = {i: [s for s in shard if s.table in mine] for i, shard in snaps.items()}
            configs = {s.table: s.config.to_dict() for shard in part.values() for s in shard}
            spec = self.registry.get(name)
            config: dict[str, Any] = {"name": name, "tables": [configs[n] for n in sorted(configs)]}
            if spec is not None:
                config["type"] = spec.kind
                config["numeric"] = spec.numeric
            offsets, stream = cut.books.get(name, ({}, None))
            try:
                where, nbytes = write_model_version(
                    self.root,
                    self.store,
                    name,
                    cut.version,
                    cut.snapshot,
                    part,
                    offsets,
                    config,
                    self.client.num_shards,
                    stream=stream,
                    serving_precision=self.serving_precision,
                    file_mode=self.file_mode,
                    slot_map=slot_map,
                )
            except OSError as exc:
                for done_name, done in written.items():
                    with contextlib.suppress(OSError):
                        remove_version(self.store, done_name, cut.version, done["path"])
                exc.model_dir = self._at(name)  # type: ignore[attr-defined]
                raise
            written[name] = {
                "path": where,
                "rows": sum(s.rows for shard in part.values() for s in shard),
                "bytes": nbytes,
            }
        return written

    async def _snapshot_all(self, version: int, parent: int | None) -> None:
        """Every shard copies its rows for `version`, each within
        `cut_timeout_s`; `CutFailed` lists every shard that did not."""
        kind = "base" if parent is None else "delta"
        got = await asyncio.gather(
            *(within(t.take_snapshot(version, parent), self.cut_timeout_s) for t in self.client.shards),
            return_exceptions=True,
        )
        failed: dict[int, BaseException] = {}
        for t, r in zip(self.client.shards, got):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r  # cancelled: not a failure of the cut
                failed[t.shard_id] = r
        if failed:
            if any(isinstance(e, CutNotJoinedError) for e in failed.values()):
                reason = "not_joined"  # a shard restarted since the cluster joined
            elif all(isinstance(e, ShardUnavailableError) for e in failed.values()):
                reason = "unreachable"
            elif all(isinstance(e, TimeoutError) for e in failed.values()):
                reason = "timeout"
            elif all(isinstance(e, SnapshotError) for e in failed.values()):
                reason = "refused"
            else:
                reason = "error"
            raise CutFailed(version, kind, reason, failed, self.cut_timeout_s)

    async def _abort(self, failed: CutFailed, began: float, step_began: float) -> None:
        """Drop the copies of the `failed` cut's version on every shard, each
        within `abort_timeout_s`, then log the failed cut in one WARNING line
        with where the time went (`perf_counter` times: the cut `began`, the
        step that failed, the copy or the fetch, `step_began`). A shard not
        reached keeps its copy among its few pending ones (dropped oldest
        first), and a later cut of that number replaces it."""
        step_ended = time.perf_counter()
        got = await asyncio.gather(
            *(within(t.drop_snapshot(failed.version), self.abort_timeout_s) for t in self.client.shards),
            return_exceptions=True,
        )
        unreached: dict[int, BaseException] = {}
        for t, r in zip(self.client.shards, got):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                unreached[t.shard_id] = r
        now = time.perf_counter()
        step = "fetch" if failed.reason == "fetch" else "copy"
        self._failed(
            failed.reason,
            version=failed.version,
            shards=",".join(str(i) for i in sorted(failed.by_shard)),
            error=failed.why(),
            not_aborted_on=",".join(str(i) for i in sorted(unreached)) or "-",
            # Where the time went since the cut began: the copy follows the
            # wait for leased windows; the fetch, the copy; then the drops.
            after_s=round(now - began, 1),
            step=step,
            **({"lease_wait_s": round(step_began - began, 1)} if step == "copy" else {}),
            step_s=round(step_ended - step_began, 1),
            abort_s=round(now - step_ended, 1),
            **(
                {
                    "abort_error": "; ".join(
                        describe_failure(i, e, self.abort_timeout_s) for i, e in sorted(unreached.items())
                    )
                }
                if unreached
                else {}
            ),
        )

    def _failed(self, reason: str, **fields: object) -> None:
        """Count a failed cut or write and log it: one WARNING line."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        log.warning(
            "export cut aborted" if reason not in ("disk", "prune") else "export write failed",
            extra={"fields": {"reason": reason, **fields}},
        )

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: exports written and failures by reason, the
        age of the last export (of the exporter, before its first) and the interval."""
        return {
            "exports": self.exports,
            "age_s": round(time.monotonic() - self._last_at, 3),
            "interval_s": self.interval_s,
            "failures": dict(self.failures),
            "last_version": self.last.version if self.last is not None else None,
            "cuts_spent": self.coordinator.cuts_spent,
        }

    def _chain_is_whole(self) -> bool:
        """Whether the newest version on disk of every model that has
        versions is the coordinator's last cut, so a delta on it can be read back."""
        if self.coordinator.last_version == 0:
            return False
        newest = []
        for name in self.registry.names():
            versions = versions_at(self._at(name))
            if versions:
                newest.append(versions[-1].version)
        return bool(newest) and all(v == self.coordinator.last_version for v in newest)

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Export every `interval_s` seconds until `stop`; a failed export is
        logged and retried at the next tick (as a base)."""
        self.interval_s = interval_s
        while not stop.is_set():
            try:
                await within(stop.wait(), interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.cut()
            except (CutAbortedError, ExportWriteError):
                pass  # logged (one line) and counted where it failed
            except (ClusterNotReadyError, NoCommonVersionError) as exc:
                # Shards joining or restoring: nothing consistent to cut yet.
                self.failures["not_ready"] = self.failures.get("not_ready", 0) + 1
                log.warning("export skipped", extra={"fields": {"reason": "not_ready", "error": exc.detail}})
            except Exception as exc:  # one failed export must not end exporting
                self.failures["error"] = self.failures.get("error", 0) + 1
                log.warning("export failed", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})

    # -- the cluster's models ---------------------------------------------------
    def model_json(self, name: str) -> ModelEntry:
        """Model `name`'s declaration (`UnknownModelError` when the cluster has
        none); the default model, if not created, with type null."""
        spec = self.registry.get(name)
        if spec is not None:
            return msgspec.convert(spec.to_dict(), ModelEntry)
        self.registry.check(name)
        return ModelEntry(name=name, type=None, tables=[])

    def models_json(self) -> ShardModelListBody:
        """The default model and every model (``GET /v1/models``)."""
        return ShardModelListBody(self.registry.default, [self.model_json(n) for n in self.registry.names()])

    async def create_model(self, spec: ModelSpec) -> bool:
        """Declare `spec`'s tables on every shard, then record it (and its
        ``model.json``); True when it is new. Between cuts, so a cut never
        meets a model half made. A table declared otherwise on a shard is
        `TableConflictError` (or `ModeConflictError`), nothing recorded.
        The same declaration again is answered at once (False), not after
        the cut in progress: a restarted worker creates its model while a cut
        may wait for the lease its predecessor held."""
        if self.registry.get(spec.name) is not None:
            self.registry.check_new(spec)  # another declaration: ModelConflictError
            return False
        async with self._lock:
            self.registry.check_new(spec)
            for config in spec.tables:
                await self.client.declare(config)
            created = await asyncio.to_thread(self.registry.create, spec)
        if created:
            log.info(
                "model created",
                extra={
                    "fields": {
                        "model": spec.name,
                        "type": spec.kind,
                        "mode": spec.mode,
                        "tables": ",".join(spec.table_names),
                    }
                },
            )
        return created

    async def create_model_json(self, body: ModelDeclaration) -> ShardModelCreatedBody:
        """`create_model` of a recipe (`ModelSpec.recipe`): whether it is new, and the model."""
        spec = ModelSpec.from_recipe(msgspec.to_builtins(body))
        return ShardModelCreatedBody(await self.create_model(spec), self.model_json(spec.name))

    async def delete_model(self, name: str) -> ShardModelDeletedBody:
        """Drop model `name`'s tables on every shard, forget it and its
        offsets; its exports stay on disk. The default model cannot be
        deleted (`ModelConflictError`): it holds the tables declared by hand."""
        if name == self.model:
            raise ModelConflictError(f"model {name} is this cluster's default model (--model-name): it is not deleted")
        async with self._lock:
            spec = self.registry.get(name)
            if spec is None:
                raise UnknownModelError(
                    f"no model {name!r} created in this cluster; models: {', '.join(self.registry.names())}"
                )
            dropped = [t for t in spec.table_names if await self.client.drop_table(t)]
            await asyncio.to_thread(self.registry.delete, name)
            self.coordinator.forget(name)
        mdir = self._at(name)
        log.info(
            "model deleted", extra={"fields": {"model": name, "tables": ",".join(dropped) or "-", "exports": str(mdir)}}
        )
        deleted = msgspec.convert(spec.to_dict(), ModelEntry)
        kept = mdir.is_dir() if isinstance(mdir, Path) else bool(mdir.versions())
        return ShardModelDeletedBody(deleted, dropped, str(mdir) if kept else None)

    async def export_json(self, kind: str | None = None) -> ExportReportBody:
        """`cut`, answered as its message (``POST /v1/exports``)."""
        return msgspec.convert((await self.cut(kind)).to_dict(), ExportReportBody)

    async def compact(self, model: str | None = None) -> Compaction:
        """Fold `model`'s newest chain into a base of its newest version (same
        version, offsets and rows; deltas after it stay valid), then prune;
        one at a time with cuts, since both rewrite the directory."""
        mdir = self.dir_of(model)
        if not isinstance(mdir, Path):
            raise InvalidRequestError(f"compaction of exports on object storage ({mdir}) is not supported")
        async with self._lock:
            t0 = time.perf_counter()
            info = await asyncio.to_thread(compact, mdir, file_mode=self.file_mode)
            pruned = await asyncio.to_thread(prune, mdir, self.keep_bases)
            out = Compaction(
                model=mdir.name,
                version=info.version,
                kind="base",
                compacted_from=list(info.manifest.compacted_from),
                rows=info.manifest.rows(),
                bytes=info.manifest.nbytes(),
                pruned=pruned,
                seconds=round(time.perf_counter() - t0, 3),
            )
        fields = {k: v for k, v in msgspec.structs.asdict(out).items() if k != "compacted_from"}
        log.info("compacted", extra={"fields": fields})
        return out

    def exports_json(self, model: str | None = None) -> ExportList:
        """`model`'s versions and the last export's report (``GET /v1/exports``)."""
        name = model or self.model
        self.registry.check(name)
        last = self.last.to_dict() if self.last is not None else None
        if last is not None and name != self.model:
            mine = self.last.models.get(name) if self.last is not None else None
            last = None if mine is None else {**last, **mine, "offsets": self._offsets_json(name)}
        return ExportList(name, self.versions(name), msgspec.convert(last, ExportReportBody | None))

    def _offsets_json(self, model: str) -> dict[str, dict[str, int]]:
        versions = versions_at(self._at(model))
        if not versions:
            return {}
        return {t: {str(p): o for p, o in ps.items()} for t, ps in versions[-1].manifest.offsets.items()}

    def versions(self, model: str | None = None) -> list[VersionEntry]:
        """`model`'s versions on disk, oldest first (times in RFC 3339, as orjson writes a datetime)."""
        found = versions_at(self.dir_of(model))
        return [
            VersionEntry(v.version, v.kind, v.parent, v.created_at.isoformat(), v.manifest.rows(), v.manifest.nbytes())
            for v in found
        ]
