"""The control plane's calls, each declared once.

A `ControlCall` names one call of the control plane: the `ShardControl`
method that makes it (`ps_core.checkpoint.control`), its HTTP method and
path, the scope a token needs for it, the model of its request body and the
model of its reply (`ps_core.net.control_messages`). From these declarations:

- the shard app registers each route (`ControlCall.route`) and decodes its
  body (`ControlCall.decoder`), and `ps_core.net.server.ROUTE_SCOPES` takes
  each route's scope;
- the HTTP client (`ps_core.checkpoint.control.HttpControl`) encodes the
  request from the same model and decodes the reply (`ControlCall.read`).

Adding a call is one declaration here, the server's handler, and the
client's method. Every reply is decoded into its model (stats, the status
board, the coordinator's offsets, exports and models too), but a snapshot's
bytes.

A reply's fields this client does not know are dropped, at any depth,
before it is decoded, so a newer shard adding one to its answer is still understood.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import msgspec
import msgspec.inspect as mi
import orjson
from aiohttp import web

from ..errors import PSError
from ..store.board import StatusReport
from .auth import Scope
from .control_messages import (
    Admit,
    Compaction,
    Dropped,
    ExportList,
    ExportReportBody,
    ExportRequest,
    HandOff,
    KnownOffsets,
    LeaseBody,
    LeaseRenewal,
    LeaseRequest,
    MembershipBody,
    ModelDeclaration,
    ModelEntry,
    MoveRequest,
    Release,
    Released,
    Renewed,
    Restore,
    Restored,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
    SlotMapBody,
    SlotMapTaken,
    SlotsMoved,
    SnapshotRequest,
    SnapshotRows,
    StatusAck,
    StatusBoardBody,
    SyncApplied,
    SyncApply,
    SyncArrive,
    SyncMember,
    SyncStep,
    TableDropped,
    TakenOver,
)
from .shard_bodies import Declared, Stats, TableDeclaration

__all__ = ["ControlCall", "CONTROL_CALLS", "ControlReplyError", "with_model", "Req", "Rep"]

Req = TypeVar("Req")
"""A call's request model."""
Rep = TypeVar("Rep")
"""A call's reply model."""
Handler = Callable[[web.Request], Any]


class ControlReplyError(PSError, code="bad_control_reply", status=502):
    """A shard answered a control call with a body that is not the call's reply."""


@dataclass(frozen=True)
class ControlCall(Generic[Req, Rep]):
    """One call of the control plane (see the module's docstring)."""

    name: str
    """The `ShardControl` method making it."""
    method: str
    path: str
    """The route's path as aiohttp declares it (``{version}`` a path parameter)."""
    scope: Scope
    """The scope a token needs for it (`ps_core.net.auth`)."""
    request: type[Req] | None
    """The JSON body's model (None: the call sends no body)."""
    reply: type[Rep]
    """The reply's model; ``bytes`` for a binary body."""
    coordinator: bool = False
    """Served by the shard hosting the coordinator (shard 0) only: a 404 there means it hosts none."""
    answered: tuple[str, ...] = ()
    """Error codes of a retried status that are the server's own answer (raised at once)."""
    head: bool = True
    """A GET route answers HEAD too (not a snapshot's: a HEAD would hand it over unseen)."""

    @property
    def key(self) -> tuple[str, str]:
        """``(method, path)``, as `ps_core.net.server.ROUTE_SCOPES` names routes."""
        return (self.method, self.path)

    @functools.cached_property
    def decoder(self) -> msgspec.json.Decoder[Req]:
        """The server's decoder of the request body."""
        if self.request is None:
            raise TypeError(f"{self.name} sends no body")
        return msgspec.json.Decoder(self.request)

    def route(self, table: web.RouteTableDef) -> Callable[[Handler], Handler]:
        """Declare the handler of this call in `table` (a decorator)."""
        if self.method == "GET":
            return table.get(self.path, allow_head=self.head)
        return table.route(self.method, self.path)

    def at(self, **params: str | int) -> str:
        """The path with its parameters filled in (quoted)."""
        return self.path.format(**{k: quote(str(v), safe="") for k, v in params.items()})

    def read(self, raw: bytes) -> Rep:
        """The reply decoded into its model; `ControlReplyError` naming the
        field when it is not one (fields unknown to the model are dropped)."""
        if self.reply is bytes:
            return raw  # type: ignore[return-value]  # Rep is bytes: a binary reply
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ControlReplyError(f"{self.method} {self.path} answered a body that is not JSON: {exc}") from None
        try:
            doc = _known(doc, self._reply_info)
            return msgspec.convert(doc, self.reply)
        except msgspec.ValidationError as exc:
            raise ControlReplyError(f"{self.method} {self.path} answered an unexpected body: {exc}") from None

    @functools.cached_property
    def _reply_info(self) -> mi.Type:
        return mi.type_info(self.reply)


def _known(doc: Any, info: mi.Type) -> Any:
    """`doc` without the fields its model does not know, at any depth (a
    newer shard's addition), as it is where it is not the model's shape."""
    if isinstance(info, mi.Metadata):  # an annotated type (its description)
        return _known(doc, info.type)
    if isinstance(info, mi.UnionType):
        shapes = [t for t in info.types if isinstance(t, (mi.StructType, mi.ListType, mi.DictType))]
        return _known(doc, shapes[0]) if len(shapes) == 1 else doc
    if isinstance(info, mi.StructType) and isinstance(doc, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        return {k: _known(v, fields[k]) for k, v in doc.items() if k in fields}
    if isinstance(info, mi.ListType) and isinstance(doc, list):
        return [_known(v, info.item_type) for v in doc]
    if isinstance(info, mi.DictType) and isinstance(doc, dict):
        return {k: _known(v, info.value_type) for k, v in doc.items()}
    return doc


def with_model(path: str, model: str | None) -> str:
    """`path` asking for `model`'s (None: the default model's)."""
    return path if model is None else f"{path}?model={quote(model, safe='')}"


_READ, _TRAIN, _ADMIN = Scope.READ, Scope.TRAIN, Scope.ADMIN

# -- every shard ------------------------------------------------------------------------
DECLARE = ControlCall("declare", "POST", "/v1/tables", _TRAIN, TableDeclaration, Declared)
DROP_TABLE = ControlCall[None, TableDropped]("drop_table", "DELETE", "/v1/tables/{name}", _ADMIN, None, TableDropped)
STATS = ControlCall[None, Stats]("stats", "GET", "/v1/stats", _READ, None, Stats)
REPORT_STATUS = ControlCall("report_status", "POST", "/v1/status", _TRAIN, StatusReport, StatusAck)
STATUSES = ControlCall[None, StatusBoardBody]("statuses", "GET", "/v1/status", _READ, None, StatusBoardBody)
TAKE_SNAPSHOT = ControlCall("take_snapshot", "POST", "/v1/snapshots", _ADMIN, SnapshotRequest, SnapshotRows)
FETCH_SNAPSHOT = ControlCall[None, bytes](
    "fetch_snapshot", "GET", "/v1/snapshots/{version}", _ADMIN, None, bytes, head=False
)
DROP_SNAPSHOT = ControlCall[None, Dropped]("drop_snapshot", "DELETE", "/v1/snapshots/{version}", _ADMIN, None, Dropped)
SLOT_MAP = ControlCall[None, SlotMapBody]("slot_map", "GET", "/v1/slots", _READ, None, SlotMapBody)
ADOPT_SLOT_MAP = ControlCall("adopt_slot_map", "PUT", "/v1/slots", _ADMIN, SlotMapBody, SlotMapTaken)
HAND_OFF = ControlCall[HandOff, bytes]("hand_off", "POST", "/v1/slots/hand_off", _ADMIN, HandOff, bytes)
TAKE_OVER = ControlCall[None, TakenOver]("take_over", "POST", "/v1/slots/take_over", _ADMIN, None, TakenOver)
MOVE_SLOTS = ControlCall("move_slots", "POST", "/v1/slots/move", _ADMIN, MoveRequest, SlotsMoved, coordinator=True)
RELEASE_SLOTS = ControlCall[None, Dropped]("release_slots", "DELETE", "/v1/slots/held/{epoch}", _ADMIN, None, Dropped)
MEMBERSHIP = ControlCall[None, MembershipBody]("membership", "GET", "/v1/membership", _ADMIN, None, MembershipBody)
ADMIT = ControlCall("admit", "POST", "/v1/membership/admit", _ADMIN, Admit, MembershipBody)
RESTORE = ControlCall("restore_version", "POST", "/v1/restore", _ADMIN, Restore, Restored)
SYNC_APPLY = ControlCall("sync_apply", "POST", "/v1/sync/apply", _TRAIN, SyncApply, SyncApplied)

# -- the coordinator, on shard 0 --------------------------------------------------------
ACQUIRE_LEASE = ControlCall(
    "acquire_lease",
    "POST",
    "/v1/leases",
    _TRAIN,
    LeaseRequest,
    LeaseBody,
    coordinator=True,
    # A cut's 503 is the coordinator's answer, not a proxy's: raised at
    # once, naming the lease the cut waits for (the caller asks again).
    answered=("cut_in_progress",),
)
RENEW_LEASE = ControlCall("renew_lease", "POST", "/v1/leases/renew", _TRAIN, LeaseRenewal, Renewed, coordinator=True)
RELEASE_LEASE = ControlCall("release_lease", "POST", "/v1/leases/release", _TRAIN, Release, Released, coordinator=True)
OFFSETS = ControlCall[None, KnownOffsets](
    "coordinator_resume", "GET", "/v1/offsets", _TRAIN, None, KnownOffsets, coordinator=True
)
SYNC_JOIN = ControlCall("sync_join", "POST", "/v1/sync/join", _TRAIN, SyncMember, SyncStep, coordinator=True)
SYNC_LEAVE = ControlCall("sync_leave", "POST", "/v1/sync/leave", _TRAIN, SyncMember, SyncStep, coordinator=True)
SYNC_ARRIVE = ControlCall("sync_arrive", "POST", "/v1/sync/arrive", _TRAIN, SyncArrive, SyncStep, coordinator=True)

# -- the exporter and the models' registry, on shard 0 ----------------------------------
EXPORT_NOW = ControlCall("export_now", "POST", "/v1/exports", _ADMIN, ExportRequest, ExportReportBody, coordinator=True)
EXPORTS = ControlCall[None, ExportList]("exports", "GET", "/v1/exports", _READ, None, ExportList, coordinator=True)
COMPACT = ControlCall[None, Compaction](
    "compact_exports", "POST", "/v1/exports/compact", _ADMIN, None, Compaction, coordinator=True
)
MODELS = ControlCall[None, ShardModelListBody](
    "models", "GET", "/v1/models", _READ, None, ShardModelListBody, coordinator=True
)
MODEL_INFO = ControlCall[None, ModelEntry](
    "model_info", "GET", "/v1/models/{name}", _READ, None, ModelEntry, coordinator=True
)
# Train scope, as table declarations: a worker creates its model.
CREATE_MODEL = ControlCall(
    "create_model", "POST", "/v1/models", _TRAIN, ModelDeclaration, ShardModelCreatedBody, coordinator=True
)
DELETE_MODEL = ControlCall[None, ShardModelDeletedBody](
    "delete_model", "DELETE", "/v1/models/{name}", _ADMIN, None, ShardModelDeletedBody, coordinator=True
)

CONTROL_CALLS: tuple[ControlCall[Any, Any], ...] = (
    DECLARE,
    DROP_TABLE,
    STATS,
    REPORT_STATUS,
    STATUSES,
    TAKE_SNAPSHOT,
    FETCH_SNAPSHOT,
    DROP_SNAPSHOT,
    SLOT_MAP,
    ADOPT_SLOT_MAP,
    HAND_OFF,
    TAKE_OVER,
    RELEASE_SLOTS,
    MOVE_SLOTS,
    MEMBERSHIP,
    ADMIT,
    RESTORE,
    SYNC_APPLY,
    ACQUIRE_LEASE,
    RENEW_LEASE,
    RELEASE_LEASE,
    OFFSETS,
    SYNC_JOIN,
    SYNC_LEAVE,
    SYNC_ARRIVE,
    EXPORT_NOW,
    EXPORTS,
    COMPACT,
    MODELS,
    MODEL_INFO,
    CREATE_MODEL,
    DELETE_MODEL,
)
"""Every call of the control plane, each route once."""
