"""What one export did (`ExportReport`): the version, its files, its offsets
and how long each step took; `ps_core.checkpoint.exporter` makes one per cut."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .coordinator import Offsets
from .stream import StreamIdentity

__all__ = ["ExportReport"]


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
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per model written: ``path``, ``rows`` and ``bytes`` (`path`, `rows`,
    `bytes` and `offsets` above are the default model's, or the model asked for)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields: offsets with string partitions, durations in ms."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        for seconds in ("lease_wait_s", "pause_s", "write_s"):
            body[seconds.removesuffix("_s") + "_ms"] = round(body.pop(seconds) * 1000, 3)
        body["offsets"] = {t: {str(p): o for p, o in ps.items()} for t, ps in self.offsets.items()}
        body["stream"] = self.stream.to_dict() if self.stream is not None else None
        return body
