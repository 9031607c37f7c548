"""Export cuts of a model's shards into ``<root>/<model>/``.

`Exporter.cut` runs one export: the coordinator's pause (wait for leased
windows, every shard copies its rows: `Shard.take_snapshot`), then, with
leases granted again, it fetches the copies from the shards and writes the
version (`ps_core.export.write_version`, in a thread) and prunes old ones.

The exporter runs where the coordinator runs (shard 0, or ``ctrps demo``)
and reaches every shard through a `PSClient`, so shards need no shared
storage: only the exporter writes files.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import PSClient
from .coordinator import Coordinator, Offsets
from .export import compact, list_versions, prune, write_version
from .manifest import check_model_name
from .stream import StreamIdentity

__all__ = ["Exporter", "ExportReport"]

log = logging.getLogger("ctrps.export")


@dataclass(frozen=True)
class ExportReport:
    """What one export did."""

    version: int
    """The version written."""
    kind: str
    """``base`` or ``delta``."""
    parent: int | None
    """The version a delta applies on (None for a base)."""
    path: str
    """Its directory."""
    rows: int
    """Rows in all files."""
    bytes: int
    """Bytes of all files."""
    offsets: Offsets
    """Committed offsets the version holds."""
    lease_wait_s: float
    """How long the cut waited for leased windows."""
    pause_s: float
    """How long leases were refused (the wait plus the shards' copies)."""
    write_s: float
    """Fetching the copies and writing the files, after the pause."""
    expired_leases: list[str] = field(default_factory=list)
    """Workers whose leases expired during the wait."""
    pruned: list[int] = field(default_factory=list)
    """Versions removed by retention."""
    stream: StreamIdentity | None = None
    """The stream the offsets were read from (None: not known)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (offsets with string partitions)."""
        return {
            "version": self.version,
            "kind": self.kind,
            "parent": self.parent,
            "path": self.path,
            "rows": self.rows,
            "bytes": self.bytes,
            "offsets": {t: {str(p): o for p, o in ps.items()} for t, ps in self.offsets.items()},
            "lease_wait_ms": round(self.lease_wait_s * 1000, 3),
            "pause_ms": round(self.pause_s * 1000, 3),
            "write_ms": round(self.write_s * 1000, 3),
            "expired_leases": self.expired_leases,
            "pruned": self.pruned,
            "stream": self.stream.to_dict() if self.stream is not None else None,
        }


class Exporter:
    """Cuts and writes versions of one model; one cut at a time."""

    def __init__(
        self,
        coordinator: Coordinator,
        client: PSClient,
        root: Path | str,
        model: str,
        *,
        keep_bases: int = 2,
    ) -> None:
        self.coordinator = coordinator
        self.client = client
        self.model = check_model_name(model)
        self.root = Path(root)
        self.keep_bases = keep_bases
        self._lock = asyncio.Lock()
        # Set when a cut paused but its files were not written: the shards
        # moved on, so only a base can follow.
        self._need_base = False
        self.last: ExportReport | None = None
        """The latest export written."""

    @property
    def model_dir(self) -> Path:
        """``<root>/<model>``."""
        return self.root / self.model

    @staticmethod
    def resume_point(model_dir: Path) -> tuple[int, Offsets]:
        """The newest version in `model_dir` and its offsets ((0, {}) when none):
        where a coordinator starts so versions never collide."""
        versions = list_versions(model_dir) if model_dir.is_dir() else []
        if not versions:
            return 0, {}
        newest = versions[-1]
        return newest.version, {t: dict(p) for t, p in newest.manifest.offsets.items()}

    async def cut(self, kind: str | None = None) -> ExportReport:
        """Cut, then write; `kind` forces ``base`` or ``delta`` (default: the
        coordinator's schedule, a base after a failed write)."""
        async with self._lock:
            if self._need_base or not self._chain_is_whole():
                kind = "base"
            t0 = time.perf_counter()

            async def snapshot(version: int, cut_kind: str) -> int | None:
                parent = self.coordinator.last_version if cut_kind == "delta" else None
                await self.client.take_snapshots(version, parent)
                return parent

            try:
                cut = await self.coordinator.cut(snapshot, kind)
            except BaseException:
                # Some shards may have cut and moved on: the next cut is a base.
                self._need_base = True
                raise
            self._need_base = True
            try:
                snaps = await self.client.fetch_snapshots(cut.version)
                tables = {s.table: s.config.to_dict() for shard in snaps.values() for s in shard}
                config = {"name": self.model, "tables": [tables[n] for n in sorted(tables)]}
                path = await asyncio.to_thread(
                    write_version, self.root, self.model, cut.version, cut.snapshot, snaps,
                    cut.offsets, config, self.client.num_shards, stream=cut.stream,
                )
                pruned = await asyncio.to_thread(prune, self.model_dir, self.keep_bases)
            except BaseException:
                log.error("export failed after its cut", extra={"fields": {"version": cut.version}})
                raise
            self._need_base = False
            files = [s for shard in snaps.values() for s in shard]
            report = ExportReport(
                version=cut.version,
                kind=cut.kind,
                parent=cut.snapshot,
                path=str(path),
                rows=sum(s.rows for s in files),
                bytes=sum(p.stat().st_size for p in Path(path).iterdir()),
                offsets=cut.offsets,
                lease_wait_s=cut.lease_wait_s,
                pause_s=cut.pause_s,
                write_s=time.perf_counter() - t0 - cut.pause_s,
                expired_leases=cut.expired_leases,
                pruned=pruned,
                stream=cut.stream,
            )
            self.last = report
            log.info(
                "export",
                extra={"fields": {k: v for k, v in report.to_dict().items() if k not in ("offsets", "path", "stream")}},
            )
            return report

    def _chain_is_whole(self) -> bool:
        """Whether the newest version on disk is the coordinator's last cut,
        so a delta on it can be read back."""
        if self.coordinator.last_version == 0:
            return False
        versions = list_versions(self.model_dir) if self.model_dir.is_dir() else []
        return bool(versions) and versions[-1].version == self.coordinator.last_version

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Export every `interval_s` seconds until `stop`; a failed export is
        logged and retried at the next tick (as a base)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.cut()
            except Exception as exc:  # one failed export must not end exporting
                log.warning("export failed", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})

    async def export_json(self, kind: str | None = None) -> dict[str, Any]:
        """`cut`, answered as JSON (``POST /v1/exports``)."""
        return (await self.cut(kind)).to_dict()

    async def compact(self) -> dict[str, Any]:
        """Fold the newest chain into a base of its newest version (same
        version, offsets and rows; deltas after it stay valid), then prune;
        one at a time with cuts, since both rewrite the directory."""
        async with self._lock:
            t0 = time.perf_counter()
            info = await asyncio.to_thread(compact, self.model_dir)
            pruned = await asyncio.to_thread(prune, self.model_dir, self.keep_bases)
            out = {
                "version": info.version,
                "kind": info.kind,
                "compacted_from": list(info.manifest.compacted_from),
                "rows": info.manifest.rows(),
                "bytes": info.manifest.nbytes(),
                "pruned": pruned,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        log.info("compacted", extra={"fields": {k: v for k, v in out.items() if k != "compacted_from"}})
        return out

    def exports_json(self) -> dict[str, Any]:
        """The model, its versions and the last export's report (``GET /v1/exports``)."""
        last = self.last.to_dict() if self.last is not None else None
        return {"model": self.model, "versions": self.versions(), "last": last}

    def versions(self) -> list[dict[str, Any]]:
        """The versions on disk, oldest first, as JSON-ready dicts."""
        if not self.model_dir.is_dir():
            return []
        return [
            {
                "version": v.version,
                "kind": v.kind,
                "parent": v.parent,
                "created_at": v.created_at,
                "rows": v.manifest.rows(),
                "bytes": v.manifest.nbytes(),
            }
            for v in list_versions(self.model_dir)
        ]

