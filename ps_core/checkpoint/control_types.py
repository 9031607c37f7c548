"""The control plane's values that its clients share: a granted lease
(`LeaseGrant`), where the coordinator says to resume (`ResumePoint`), what a
release may say (`ReleaseFields`), and what an in-process transport needs
of the exporter (`ExportService`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypedDict

import msgspec

from ..net.control_messages import (
    Compaction,
    ExportList,
    ExportReportBody,
    KnownOffsets,
    ModelDeclaration,
    ModelEntry,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
)
from .coordinator import Offsets, parse_offsets
from .stream import StreamIdentity

__all__ = ["LeaseGrant", "ResumePoint", "ReleaseFields", "ExportService"]


class LeaseGrant(NamedTuple):
    """A lease granted by the coordinator."""

    lease_id: int
    """What `release_lease` names."""
    epoch: str
    """The coordinator's life (`ps_core.checkpoint.coordinator.Coordinator.epoch`)."""


class ResumePoint(NamedTuple):
    """Where the coordinator says the shards' state ends, and in which stream."""

    offsets: Offsets
    """Next offset to consume per topic and partition."""
    stream: StreamIdentity | None
    """The stream they were read from (None: not known, e.g. an older export)."""
    restored: int | None = None
    """The export version the shards' state was loaded from under the
    coordinator's epoch (0: they started empty; None: not known)."""

    @classmethod
    def of(cls, got: KnownOffsets) -> ResumePoint:
        """A ``GET /v1/offsets`` answer (an older coordinator's, without
        ``restored``: restored not known)."""
        stream = None if got.stream is None else StreamIdentity.from_body(got.stream)
        restored = None if isinstance(got.restored, msgspec.UnsetType) else got.restored
        return cls(parse_offsets(got.offsets), stream, restored)


class ReleaseFields(TypedDict, total=False):
    """What a lease's release may say beside its offsets."""

    stream: StreamIdentity | None
    """Where the offsets were read (cluster, group, topics)."""
    model: str | None
    """The model the offsets are of (None: the default model)."""
    also: Sequence[str]
    """Models the same window trained, whose offsets these are too."""


class ExportService(Protocol):
    """What shard 0's transport needs of an in-process exporter (`exporter.Exporter`)."""

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every cut (and every slot move)."""
        ...

    async def export_json(self, kind: str | None = None) -> ExportReportBody: ...

    def exports_json(self, model: str | None = None) -> ExportList: ...

    async def compact(self, model: str | None = None) -> Compaction: ...

    def models_json(self) -> ShardModelListBody: ...

    def model_json(self, name: str) -> ModelEntry: ...

    async def create_model_json(self, body: ModelDeclaration) -> ShardModelCreatedBody: ...

    async def delete_model(self, name: str) -> ShardModelDeletedBody: ...
