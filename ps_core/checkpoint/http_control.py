"""A shard server's control routes over HTTP (`HttpControl`): what
`ps_core.checkpoint.control.ControlClient` calls a remote shard through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import msgspec

from ..bodies import check
from ..errors import (
    ExportNotFoundError,
    InvalidRequestError,
    LeaseError,
    NoCoordinatorError,
    PSError,
    TableConfigError,
    UnknownModelError,
)
from ..net import control_calls as calls
from ..net.control_calls import ControlCall, Rep, Req, with_model
from ..net.control_messages import (
    Admit,
    BoardEntry,
    Compaction,
    ExportList,
    ExportReportBody,
    ExportRequest,
    HandOff,
    LeaseRenewal,
    LeaseRequest,
    MembershipBody,
    ModelDeclaration,
    ModelEntry,
    MoveRequest,
    Release,
    Restore,
    Restored,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
    SlotMapBody,
    SlotsMoved,
    SnapshotRequest,
    StatusAck,
    SyncApply,
    SyncArrive,
    SyncMember,
)
from ..net.endpoint import ShardEndpoint
from ..net.shard_bodies import Stats, TableDeclaration
from ..net.snapshot_transfer import slot_rows_from_bytes, slot_rows_to_bytes, snapshots_from_bytes
from ..slots import SlotMap
from ..store.board import StatusReport, WorkerStatus
from ..store.snapshot import TableSnapshot
from ..store.table_config import TableConfig
from .control_types import LeaseGrant, ReleaseFields, ResumePoint
from .coordinator import Offsets

__all__ = ["HttpControl"]


class HttpControl(ShardEndpoint):
    """A shard server's control routes, JSON over its HTTP port: each call
    as `ps_core.net.control_calls` declares it."""

    async def _exchange(self, call: ControlCall[Any, Any], body: object, path: str | None) -> tuple[int, bytes]:
        """`call`'s (status, reply body); on a route of the coordinator's, a
        404 that names no error of its own is `NoCoordinatorError`."""
        data: bytes | None = None
        kind = ""
        if isinstance(body, bytes):  # a binary body (a slot move's rows)
            data, kind = body, "application/octet-stream"
        elif body is not None:
            data, kind = msgspec.json.encode(body), "application/json"
        try:
            return await self.request(call.method, path or call.path, data, kind, answered=call.answered)
        except PSError as exc:
            if (
                call.coordinator
                and exc.status == 404
                and not isinstance(exc, (LeaseError, NoCoordinatorError, ExportNotFoundError, UnknownModelError))
            ):
                # The route is not there: this shard serves no coordinator.
                raise NoCoordinatorError(f"shard {self.shard_id} at {self.url} hosts no coordinator") from None
            raise

    async def _call(self, call: ControlCall[Req, Rep], body: Req | None = None, path: str | None = None) -> Rep:
        """`call`'s reply, decoded into its model."""
        _, reply = await self._exchange(call, body, path)
        return call.read(reply)

    async def declare(self, config: TableConfig) -> bool:
        body = check(config.to_dict(), TableDeclaration, TableConfigError)
        status, _ = await self._exchange(calls.DECLARE, body, None)
        return status == 201

    async def stats(self) -> Stats:
        return await self._call(calls.STATS)

    async def report_status(self, source: str, status: WorkerStatus) -> StatusAck:
        # The shard checks the report (`StatusError` naming the field, the source's too).
        return await self._call(calls.REPORT_STATUS, StatusReport(source, status))

    async def statuses(self) -> list[BoardEntry]:
        return (await self._call(calls.STATUSES)).statuses

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]:
        return (await self._call(calls.TAKE_SNAPSHOT, SnapshotRequest(version, parent))).rows

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]:
        return snapshots_from_bytes(
            await self._call(calls.FETCH_SNAPSHOT, path=calls.FETCH_SNAPSHOT.at(version=version))
        )

    async def drop_snapshot(self, version: int) -> bool:
        return (await self._call(calls.DROP_SNAPSHOT, path=calls.DROP_SNAPSHOT.at(version=version))).dropped

    async def membership(self) -> MembershipBody:
        return await self._call(calls.MEMBERSHIP)

    async def slot_map(self) -> SlotMapBody:
        return await self._call(calls.SLOT_MAP)

    async def adopt_slot_map(self, slot_map: SlotMap) -> bool:
        body = msgspec.convert(slot_map.to_dict(), SlotMapBody)
        return (await self._call(calls.ADOPT_SLOT_MAP, body)).taken

    async def hand_off(self, slots: Sequence[int], slot_map: SlotMap) -> list[TableSnapshot]:
        body = HandOff([int(s) for s in slots], msgspec.convert(slot_map.to_dict(), SlotMapBody))
        copies, _ = slot_rows_from_bytes(await self._call(calls.HAND_OFF, body))
        return copies

    async def take_over(self, copies: Sequence[TableSnapshot], slot_map: SlotMap) -> int:
        _, reply = await self._exchange(calls.TAKE_OVER, slot_rows_to_bytes(copies, slot_map), None)
        return calls.TAKE_OVER.read(reply).rows

    async def move_slots(self, request: MoveRequest) -> SlotsMoved:
        return await self._call(calls.MOVE_SLOTS, request)

    async def release_slots(self, epoch: int) -> bool:
        return (await self._call(calls.RELEASE_SLOTS, path=calls.RELEASE_SLOTS.at(epoch=epoch))).dropped

    async def admit(self, epoch: str, version: int) -> MembershipBody:
        return await self._call(calls.ADMIT, Admit(epoch, version))

    async def restore_version(self, version: int) -> Restored:
        """Have the shard load export `version` from its exports directory
        (`ps_core.checkpoint.joining.restore_version` on its side)."""
        return await self._call(calls.RESTORE, Restore(version))

    async def acquire_lease(self, worker: str, wait_s: float, ttl_s: float | None = None) -> LeaseGrant:
        got = await self._call(calls.ACQUIRE_LEASE, LeaseRequest(worker, wait_s, ttl_s))
        return LeaseGrant(got.lease_id, got.epoch)

    async def renew_lease(self, lease_id: int) -> bool:
        return (await self._call(calls.RENEW_LEASE, LeaseRenewal(lease_id))).renewed

    async def release_lease(self, lease_id: int, offsets: Offsets, **named: Unpack[ReleaseFields]) -> bool:
        stream = named.get("stream")
        body = Release(
            lease_id,
            {t: {str(p): o for p, o in ps.items()} for t, ps in offsets.items()},
            None if stream is None else stream.to_body(),
            named.get("model"),
            list(named.get("also", ())),
        )
        return (await self._call(calls.RELEASE_LEASE, body)).released

    async def coordinator_offsets(self, model: str | None = None) -> Offsets:
        return (await self.coordinator_resume(model)).offsets

    async def sync_join(self, worker: str, model: str | None = None) -> int:
        return (await self._call(calls.SYNC_JOIN, SyncMember(worker, model))).step

    async def sync_leave(self, worker: str, model: str | None = None) -> int:
        return (await self._call(calls.SYNC_LEAVE, SyncMember(worker, model))).step

    async def sync_arrive(self, worker: str, deadline_s: float, model: str | None = None) -> int:
        return (await self._call(calls.SYNC_ARRIVE, SyncArrive(worker, deadline_s, model))).step

    async def sync_apply(self, step: int, tables: Sequence[str] | None = None) -> int:
        body = SyncApply(step, None if tables is None else list(tables))
        return (await self._call(calls.SYNC_APPLY, body)).applied

    async def coordinator_resume(self, model: str | None = None) -> ResumePoint:
        return ResumePoint.of(await self._call(calls.OFFSETS, path=with_model(calls.OFFSETS.path, model)))

    async def export_now(self, kind: str | None) -> ExportReportBody:
        body = ExportRequest() if kind is None else check({"kind": kind}, ExportRequest, InvalidRequestError)
        return await self._call(calls.EXPORT_NOW, body)

    async def exports(self, model: str | None = None) -> ExportList:
        return await self._call(calls.EXPORTS, path=with_model(calls.EXPORTS.path, model))

    async def compact_exports(self, model: str | None = None) -> Compaction:
        return await self._call(calls.COMPACT, path=with_model(calls.COMPACT.path, model))

    async def drop_table(self, name: str) -> bool:
        return (await self._call(calls.DROP_TABLE, path=calls.DROP_TABLE.at(name=name))).dropped

    async def models(self) -> ShardModelListBody:
        return await self._call(calls.MODELS)

    async def model_info(self, name: str) -> ModelEntry:
        return await self._call(calls.MODEL_INFO, path=calls.MODEL_INFO.at(name=name))

    async def create_model(self, body: ModelDeclaration) -> ShardModelCreatedBody:
        return await self._call(calls.CREATE_MODEL, body)

    async def delete_model(self, name: str) -> ShardModelDeletedBody:
        return await self._call(calls.DELETE_MODEL, path=calls.DELETE_MODEL.at(name=name))

    async def close(self) -> None:
        return None
