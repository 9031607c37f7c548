"""The control plane's messages as models: the status board, cuts,
membership and restores, leases and offsets, the sync barrier, exports and
models. One set of models for both sides: the shard's routes decode requests
with them, `ps_core.checkpoint.control.HttpControl` encodes them and decodes
the replies (each call declared in `ps_core.net.control_calls`), and the
shard's OpenAPI document (`ps_core.net.shard_openapi`) derives its schemas
from them.

A request's optional fields are left out when they hold their default
(``omit_defaults``): a request naming none reads as it did before the field
existed, to a shard of an older version too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ..bodies import NUMERIC_PATTERN
from ..errors import MoveRefusedError
from ..parsing import MAX_INT
from ..slots import SlotMap
from ..store.table_config import MAX_DIM, MAX_INIT_SCALE
from .shard_bodies import (
    MAX_WAIT_S,
    Count,
    CountsBy,
    Duration,
    ExportVersion,
    Kind,
    Mode,
    ModelName,
    NewModelName,
    Offsets,
    Optimizer,
    OptimizerName,
    Shards,
    Table,
    TableName,
    Version,
)

__all__ = [
    "SlotMapBody",
    "MoveRequest",
    "MoveStepBody",
    "SlotsMoved",
    "slot_map_of",
    "HandOff",
    "TakenOver",
    "SlotMapTaken",
    "StatusAck",
    "BoardEntry",
    "StatusBoardBody",
    "SnapshotRequest",
    "SnapshotRows",
    "Dropped",
    "MembershipBody",
    "Admit",
    "Restore",
    "Refused",
    "Restored",
    "LeaseRequest",
    "LeaseRenewal",
    "Renewed",
    "LeaseBody",
    "Stream",
    "Release",
    "Released",
    "SyncMember",
    "SyncArrive",
    "SyncStep",
    "SyncApply",
    "SyncApplied",
    "KnownOffsets",
    "ExportRequest",
    "ExportStream",
    "ModelWritten",
    "ExportReportBody",
    "Compaction",
    "VersionEntry",
    "ExportList",
    "ModelDeclaration",
    "ModelEntry",
    "ShardModelListBody",
    "ShardModelCreatedBody",
    "ShardModelDeletedBody",
    "TableDropped",
]


# -- the status board ---------------------------------------------------------------


class StatusAck(Struct, forbid_unknown_fields=True):
    source: str
    received_at: float
    sources: Shards


class BoardEntry(Struct, forbid_unknown_fields=True):
    source: str
    received_at: float
    status: dict[str, Any]


class StatusBoardBody(Struct, forbid_unknown_fields=True):
    statuses: list[BoardEntry]


# -- cuts, membership, restore -------------------------------------------------------


class SnapshotRequest(Struct, forbid_unknown_fields=True):
    """Copy every table's rows for the cut `version` (a delta of `parent`)."""

    version: Version
    parent: Version | None


class SnapshotRows(Struct, forbid_unknown_fields=True):
    rows: CountsBy


class Dropped(Struct, forbid_unknown_fields=True):
    dropped: bool


class MembershipBody(Struct, forbid_unknown_fields=True):
    shard_id: Count
    num_shards: Shards
    boot_id: str
    joined: bool
    epoch: str
    version: Count
    clean: bool
    restores: bool


class SlotMapBody(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A slot map (`ps_core.slots.SlotMap.to_dict`): its epoch, shards and
    slots, and either ``even`` (slot s on shard s % num_shards) or its owners
    as runs ``[first_slot, end, shard]``."""

    epoch: Annotated[int, Meta(ge=1, le=MAX_INT)]
    num_shards: Shards
    slots: Annotated[int, Meta(ge=1, le=1 << 20)]
    even: bool = False
    runs: list[Annotated[list[Annotated[int, Meta(ge=0, le=1 << 20)]], Meta(min_length=3, max_length=3)]] = []


def slot_map_of(body: SlotMapBody) -> SlotMap:
    """The map a body names; `MoveRefusedError` (409) for one whose parts do
    not make a map (runs that miss slots, an owner past the shards): the
    shard takes no part in a move by it."""
    try:
        return SlotMap.from_dict(msgspec.to_builtins(body))
    except ValueError as exc:
        raise MoveRefusedError(f"slot map: {exc}") from None


class HandOff(Struct, forbid_unknown_fields=True):
    """Hand off `slots` (this shard's, another's in `slot_map`): their rows,
    as a slot move's first step (`ps_core.shard.slot_moves`)."""

    slots: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 20)]], Meta(min_length=1, max_length=1 << 16)]
    slot_map: SlotMapBody


class TakenOver(Struct, forbid_unknown_fields=True):
    """Rows taken over from the shard that handed them off."""

    rows: Count


class MoveRequest(Struct, forbid_unknown_fields=True):
    """Move `slots` to shard `to`, or every slot of shard `drain` to the
    others (the least loaded first): one of the two (`ps_core.checkpoint.moves`)."""

    slots: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 20)]], Meta(max_length=1 << 20)] = []
    to: Annotated[int, Meta(ge=0, le=1 << 15)] | None = None
    drain: Annotated[int, Meta(ge=0, le=1 << 15)] | None = None


class MoveStepBody(Struct, forbid_unknown_fields=True):
    """One step of a move (`ps_core.checkpoint.moves.MoveStep`)."""

    epoch: Annotated[int, Meta(ge=1)]
    source: Count
    to: Count
    slots: Count
    rows: Count
    paused_ms: Annotated[float, Meta(ge=0)]


class SlotsMoved(Struct, forbid_unknown_fields=True):
    """The map after a move, and its steps."""

    slot_map: SlotMapBody
    steps: list[MoveStepBody]


class SlotMapTaken(Struct, forbid_unknown_fields=True):
    """Whether the shard took the map (False: it held that epoch or a newer one)."""

    taken: bool


class Admit(Struct, forbid_unknown_fields=True):
    """Join the cluster under the coordinator's `epoch` at `version`."""

    epoch: Annotated[str, Meta(max_length=200)]
    version: Version


class Restore(Struct, forbid_unknown_fields=True):
    """Load `version` from the exports directory."""

    version: Version


class Refused(Struct, forbid_unknown_fields=True):
    file: str
    expected: str
    actual: str
    detail: str


class Restored(Struct, forbid_unknown_fields=True):
    version: int | None
    chain: str | UnsetType = UNSET
    rows: Count | UnsetType = UNSET
    kept: bool | UnsetType = UNSET
    refused: Refused | UnsetType = UNSET


# -- leases and offsets ---------------------------------------------------------------


class LeaseRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A lease for `worker`, waiting at most `wait_s` for a cut to end."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 30.0
    ttl_s: (
        Annotated[
            float,
            Meta(
                gt=0,
                le=MAX_WAIT_S,
                description="Seconds the lease lives unless renewed (null: the coordinator's lease TTL, also the most).",
            ),
        ]
        | None
    ) = None


class LeaseRenewal(Struct, forbid_unknown_fields=True):
    """Renew `lease_id`: it lives its time to live again from now."""

    lease_id: Annotated[int, Meta(ge=0, le=MAX_INT)]


class Renewed(Struct, forbid_unknown_fields=True):
    renewed: bool


class LeaseBody(Struct, forbid_unknown_fields=True):
    lease_id: Count
    epoch: str
    ttl_s: float


class Stream(Struct, forbid_unknown_fields=True):
    """The stream offsets were read from, as a release sends it and the
    coordinator's offsets answer it (ps_core.checkpoint.stream.StreamIdentity)."""

    cluster_id: Annotated[str, Meta(min_length=1, max_length=200)]
    group: Annotated[str, Meta(max_length=300)]
    topics: Annotated[list[str], Meta(max_length=1000)] = []


class Release(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Release `lease_id` with the offsets its window committed."""

    lease_id: Annotated[int, Meta(ge=0, le=MAX_INT)]
    offsets: Offsets = {}
    stream: Stream | None = None
    model: Annotated[ModelName | None, Meta(description="Whose offsets these are (null: the default model's).")] = None
    also: Annotated[
        list[ModelName], Meta(max_length=256, description="Further models the window trained: their offsets too.")
    ] = []


class Released(Struct, forbid_unknown_fields=True):
    released: bool


_BARRIER_MODEL = Meta(description="The model whose barrier this is (null: the default model's).")


class SyncMember(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A sync worker joining or leaving its model's barrier."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    model: Annotated[ModelName | None, _BARRIER_MODEL] = None


class SyncArrive(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A sync worker has pushed its step; the first arrival's `deadline_s`
    bounds how long the step waits for the rest."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    deadline_s: Annotated[float, Meta(ge=0, le=60)] = 5.0
    model: Annotated[ModelName | None, _BARRIER_MODEL] = None


class SyncStep(Struct, forbid_unknown_fields=True):
    """A closed step (or, from a join, the open one)."""

    step: Annotated[int, Meta(ge=0, le=MAX_INT)]


class SyncApply(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Apply what the named sync tables hold for a closed step of their
    model's barrier."""

    step: Annotated[int, Meta(ge=0, le=MAX_INT)]
    tables: Annotated[
        Annotated[list[TableName], Meta(max_length=64)] | None,
        Meta(description="The model's tables (null: every sync table of the shard)."),
    ] = None


class SyncApplied(Struct, forbid_unknown_fields=True):
    """Distinct keys a shard's sync tables updated (0: the step was applied already)."""

    applied: Count


class KnownOffsets(Struct, forbid_unknown_fields=True):
    """The coordinator's offsets of a model and the stream they were read from."""

    offsets: Offsets
    stream: Stream | None
    restored: int | UnsetType = UNSET
    """The export version the shards' state was loaded from (0: started
    empty). An older coordinator leaves it out: not known, which is not 0
    (`ps_core.checkpoint.control.ResumePoint.restored` None)."""


# -- exports --------------------------------------------------------------------------


class ExportRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The kind of version to cut; the exporter's schedule when absent."""

    kind: Kind | None = None


class ExportStream(Struct, forbid_unknown_fields=True):
    cluster_id: str
    group: str
    topics: list[str]


class ModelWritten(Struct, forbid_unknown_fields=True):
    """One model's part of a version written."""

    path: Annotated[str, Meta(description="The model's version directory on shard 0.")]
    rows: Count
    bytes: Count


class ExportReportBody(Struct, forbid_unknown_fields=True, kw_only=True):
    """A version written (ps_core.checkpoint.exporter); the fields in the
    order `ps_core.checkpoint.export_report.ExportReport.to_dict` gives them."""

    version: ExportVersion
    kind: Kind
    parent: int | None
    path: Annotated[str, Meta(description="The version's directory on shard 0.")]
    rows: Count
    bytes: Count
    offsets: Annotated[
        dict[str, CountsBy],
        Meta(description="Next offset to consume per topic and partition: where workers resume."),
    ]
    expired_leases: list[str]
    pruned: list[int]
    stream: Annotated[
        ExportStream | None,
        Meta(
            description="The stream the offsets were read from (Kafka cluster id, group, topics); "
            "null when no worker reported one."
        ),
    ]
    models: Annotated[
        dict[str, ModelWritten],
        Meta(description="Per model written: path, rows and bytes (the fields above are the model asked for)."),
    ] = {}
    lease_wait_ms: Duration
    pause_ms: Annotated[float, Meta(ge=0, description="Leases refused: the wait plus the shards' copies.")]
    write_ms: Duration


class Compaction(Struct, forbid_unknown_fields=True):
    """A base folding the newest chain (ps_core.checkpoint.exporter)."""

    model: ModelName
    version: ExportVersion
    kind: Literal["base"]
    compacted_from: Annotated[list[int], Meta(description="Empty when the newest version was a base already.")]
    rows: Count
    bytes: Count
    pruned: list[int]
    seconds: Duration


class VersionEntry(Struct, forbid_unknown_fields=True):
    version: ExportVersion
    kind: Kind
    parent: int | None
    created_at: Annotated[str, Meta(description="RFC 3339, UTC.")]
    rows: Count
    bytes: Count


class ExportList(Struct, forbid_unknown_fields=True):
    """The export versions on disk, oldest first."""

    model: str
    versions: list[VersionEntry]
    last: Annotated[
        ExportReportBody | None,
        Meta(description="The last export this process's coordinator wrote (null on a replica or before one)."),
    ]


# -- models -----------------------------------------------------------------------------


class ModelDeclaration(Struct, forbid_unknown_fields=True):
    """A model to create: its type, optimizers and update mode (a field left
    out takes the model's default; the embedding fields are fm's and an lr
    model ignores them)."""

    name: NewModelName
    type: Literal["lr", "fm"] = "lr"
    optimizer: OptimizerName | Optimizer | UnsetType = UNSET
    embedding_optimizer: OptimizerName | Optimizer | UnsetType = UNSET
    factors: Annotated[int, Meta(ge=1, le=MAX_DIM)] = 8
    init_scale: Annotated[float, Meta(ge=0, le=MAX_INIT_SCALE)] = 0.01
    seed: Annotated[int, Meta(ge=0, le=MAX_INT)] = 0
    mode: Mode = "async"
    max_staleness: Annotated[int, Meta(ge=0, le=2**31 - 1)] | UnsetType = UNSET
    numeric: (
        Annotated[
            str,
            Meta(
                pattern=NUMERIC_PATTERN.removesuffix("$") + r"\Z",
                description="Numeric features fed as sent (raw), or as sign(x) log1p(|x|) (log1p); /D divides "
                "them by D > 0; absent: log1p/16, the default.",
            ),
        ]
        | UnsetType
    ) = UNSET


class ModelEntry(Struct, forbid_unknown_fields=True, kw_only=True):
    """A model of the cluster (type null: the default model, holding tables
    declared by hand, not created as a model; it names no numeric feed)."""

    name: ModelName
    type: Literal["lr", "fm"] | None
    update_mode: str | None = None
    numeric: str | UnsetType = UNSET
    tables: list[Table]
    created_at: float | None = None


class ShardModelListBody(Struct, forbid_unknown_fields=True):
    default: ModelName
    models: list[ModelEntry]


class ShardModelCreatedBody(Struct, forbid_unknown_fields=True):
    created: bool
    model: ModelEntry


class ShardModelDeletedBody(Struct, forbid_unknown_fields=True):
    deleted: ModelEntry
    tables_dropped: list[str]
    exports: Annotated[str | None, Meta(description="Its exports directory, left in place.")]


class TableDropped(Struct, forbid_unknown_fields=True):
    dropped: bool
