"""The control plane's client: tables, stats, the status board, snapshots,
membership, leases, offsets and exports, as JSON over aiohttp.

`ControlClient` is to these what `ps_core.net.client.PSClient` is to pulls
and pushes: one `ShardControl` per shard, `HttpControl` for a shard server
(a `ShardEndpoint`: the same retries, deadline, credentials and TLS as the
data plane) or `LocalControl` for a `Shard` in this process, with the
coordinator and exporter that shard 0 hosts. Workers declare tables, report
status and take leases through it; the API reads stats and exports; the
exporter cuts; joining admits and restores; ``ctrps export`` asks for cuts.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_
from collections.abc import Sequence
from typing import Protocol, Unpack

import aiohttp
import msgspec

from ..errors import (
    InvalidRequestError,
    NoCoordinatorError,
    StatusError,
)
from ..net.client import fan_out
from ..net.control_messages import (
    BoardEntry,
    Compaction,
    ExportList,
    ExportReportBody,
    MembershipBody,
    ModelDeclaration,
    ModelEntry,
    MoveRequest,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
    SlotMapBody,
    SlotsMoved,
    StatusAck,
)
from ..net.endpoint import RetryPolicy, ShardGroup
from ..net.shard_bodies import Stats
from ..shard import Shard
from ..slots import SlotMap
from ..store.board import WorkerStatus
from ..store.snapshot import TableSnapshot
from ..store.table_config import TableConfig
from .control_types import ExportService, LeaseGrant, ReleaseFields, ResumePoint
from .coordinator import Coordinator, Offsets
from .http_control import HttpControl

__all__ = [
    "ControlClient",
    "ShardControl",
    "HttpControl",
    "LocalControl",
    "LeaseGrant",
    "ResumePoint",
    "ReleaseFields",
    "ExportService",
]


class ShardControl(Protocol):
    """How the control plane reaches one shard."""

    shard_id: int

    async def declare(self, config: TableConfig) -> bool: ...

    async def stats(self) -> Stats: ...

    async def report_status(self, source: str, status: WorkerStatus) -> StatusAck: ...

    async def statuses(self) -> list[BoardEntry]: ...

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]: ...

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]: ...

    async def drop_snapshot(self, version: int) -> bool: ...

    async def membership(self) -> MembershipBody: ...

    async def slot_map(self) -> SlotMapBody: ...

    async def adopt_slot_map(self, slot_map: SlotMap) -> bool: ...

    async def hand_off(self, slots: Sequence[int], slot_map: SlotMap) -> list[TableSnapshot]: ...

    async def take_over(self, copies: Sequence[TableSnapshot], slot_map: SlotMap) -> int: ...

    async def release_slots(self, epoch: int) -> bool: ...

    async def move_slots(self, request: MoveRequest) -> SlotsMoved: ...

    async def admit(self, epoch: str, version: int) -> MembershipBody: ...

    async def acquire_lease(self, worker: str, wait_s: float, ttl_s: float | None = None) -> LeaseGrant: ...

    async def renew_lease(self, lease_id: int) -> bool: ...

    async def release_lease(self, lease_id: int, offsets: Offsets, **named: Unpack[ReleaseFields]) -> bool: ...

    async def coordinator_offsets(self, model: str | None = None) -> Offsets: ...

    async def sync_join(self, worker: str, model: str | None = None) -> int: ...

    async def sync_leave(self, worker: str, model: str | None = None) -> int: ...

    async def sync_arrive(self, worker: str, deadline_s: float, model: str | None = None) -> int: ...

    async def sync_apply(self, step: int, tables: Sequence[str] | None = None) -> int: ...

    async def coordinator_resume(self, model: str | None = None) -> ResumePoint: ...

    async def export_now(self, kind: str | None) -> ExportReportBody: ...

    async def exports(self, model: str | None = None) -> ExportList: ...

    async def compact_exports(self, model: str | None = None) -> Compaction: ...

    async def drop_table(self, name: str) -> bool: ...

    async def models(self) -> ShardModelListBody: ...

    async def model_info(self, name: str) -> ModelEntry: ...

    async def create_model(self, body: ModelDeclaration) -> ShardModelCreatedBody: ...

    async def delete_model(self, name: str) -> ShardModelDeletedBody: ...

    async def close(self) -> None: ...


class LocalControl:
    """A shard in this process, with the coordinator (and exporter) it hosts."""

    def __init__(self, shard: Shard, coordinator: Coordinator | None = None) -> None:
        self.shard = shard
        self.shard_id = shard.spec.shard_id
        self.coordinator = coordinator
        self.exporter: ExportService | None = None
        """Set by whoever runs an exporter beside the coordinator (``ctrps demo``)."""
        self.moves: tuple[ControlClient, asyncio.Lock] | None = None
        """The client over every shard and the exporter's lock slot moves run with (`serve_exports`)."""

    async def declare(self, config: TableConfig) -> bool:
        return self.shard.declare(config)

    async def stats(self) -> Stats:
        return msgspec.convert(self.shard.stats(), Stats)

    async def report_status(self, source: str, status: WorkerStatus) -> StatusAck:
        return msgspec.convert(self.shard.report_status(source, msgspec.to_builtins(status)), StatusAck)

    async def statuses(self) -> list[BoardEntry]:
        return msgspec.convert(self.shard.statuses(), list[BoardEntry])

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]:
        return self.shard.take_snapshot(version, parent)

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]:
        return self.shard.pop_snapshot(version)

    async def drop_snapshot(self, version: int) -> bool:
        return self.shard.drop_snapshot(version)

    async def membership(self) -> MembershipBody:
        return msgspec.convert(self.shard.membership(), MembershipBody)

    async def slot_map(self) -> SlotMapBody:
        return msgspec.convert(self.shard.slot_map.to_dict(), SlotMapBody)

    async def adopt_slot_map(self, slot_map: SlotMap) -> bool:
        return self.shard.slot_moves.adopt(slot_map)

    async def hand_off(self, slots: Sequence[int], slot_map: SlotMap) -> list[TableSnapshot]:
        return self.shard.slot_moves.hand_off(slots, slot_map)

    async def take_over(self, copies: Sequence[TableSnapshot], slot_map: SlotMap) -> int:
        return self.shard.slot_moves.take_over(copies, slot_map)

    async def release_slots(self, epoch: int) -> bool:
        return self.shard.slot_moves.release(epoch) > 0

    async def move_slots(self, request: MoveRequest) -> SlotsMoved:
        from .moves import run_move  # it runs through a ControlClient, this module's: imported when used

        if self.moves is None:
            raise NoCoordinatorError(f"shard {self.shard_id} runs no exporter, and moves slots under its lock")
        client, lock = self.moves
        return await run_move(client, request, lock)

    async def admit(self, epoch: str, version: int) -> MembershipBody:
        self.shard.admit(epoch, version)
        return await self.membership()

    def _coordinator(self) -> Coordinator:
        if self.coordinator is None:
            raise NoCoordinatorError(f"shard {self.shard_id} hosts no coordinator")
        return self.coordinator

    async def acquire_lease(self, worker: str, wait_s: float, ttl_s: float | None = None) -> LeaseGrant:
        lease = await self._coordinator().acquire(worker, wait_s, ttl_s)
        return LeaseGrant(lease.lease_id, lease.epoch)

    async def renew_lease(self, lease_id: int) -> bool:
        return self._coordinator().renew(lease_id)

    async def release_lease(self, lease_id: int, offsets: Offsets, **named: Unpack[ReleaseFields]) -> bool:
        if self.exporter is not None:
            for name in (named.get("model"), *named.get("also", ())):
                if name is not None:
                    self.exporter.model_json(name)  # unknown_model, as over HTTP
        return await self._coordinator().release(lease_id, offsets, **named)

    async def coordinator_offsets(self, model: str | None = None) -> Offsets:
        return self._coordinator().offsets(model)

    async def sync_join(self, worker: str, model: str | None = None) -> int:
        return self._coordinator().barrier(model).join(worker)

    async def sync_leave(self, worker: str, model: str | None = None) -> int:
        return self._coordinator().leave_barrier(worker, model)

    async def sync_arrive(self, worker: str, deadline_s: float, model: str | None = None) -> int:
        return await self._coordinator().barrier(model).arrive(worker, deadline_s)

    async def sync_apply(self, step: int, tables: Sequence[str] | None = None) -> int:
        return self.shard.apply_step(step, tables)

    async def coordinator_resume(self, model: str | None = None) -> ResumePoint:
        c = self._coordinator()
        return ResumePoint(c.offsets(model), c.stream_of(model), c.restored)

    def _exporter(self) -> ExportService:
        if self.exporter is None:
            raise NoCoordinatorError(f"shard {self.shard_id} runs no exporter")
        return self.exporter

    async def export_now(self, kind: str | None) -> ExportReportBody:
        return await self._exporter().export_json(kind)

    async def exports(self, model: str | None = None) -> ExportList:
        return self._exporter().exports_json(model)

    async def compact_exports(self, model: str | None = None) -> Compaction:
        return await self._exporter().compact(model)

    async def drop_table(self, name: str) -> bool:
        return self.shard.drop(name)

    async def models(self) -> ShardModelListBody:
        return self._exporter().models_json()

    async def model_info(self, name: str) -> ModelEntry:
        return self._exporter().model_json(name)

    async def create_model(self, body: ModelDeclaration) -> ShardModelCreatedBody:
        return await self._exporter().create_model_json(body)

    async def delete_model(self, name: str) -> ShardModelDeletedBody:
        return await self._exporter().delete_model(name)

    async def close(self) -> None:
        return None


class ControlClient(ShardGroup[ShardControl]):
    """The control plane of every shard: declarations and stats on all of
    them, the status board and the coordinator on shard 0.

    Use ``async with ControlClient.connect(urls) as control`` for shard
    servers or ``ControlClient.local(shards, coordinator)`` in this process.
    """

    def __init__(self, shards: Sequence[ShardControl], *, session: aiohttp.ClientSession | None = None) -> None:
        super().__init__(shards, session=session)
        self.shards = self._members
        """Shard i's control at place i."""

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
    ) -> ControlClient:
        """A control client for shard servers at `urls` (shard i at urls[i]),
        presenting `token` and verifying ``https://`` shards with `ssl`.
        Must be called with an event loop running (it opens a connection pool)."""
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=4, limit=0), skip_auto_headers=("User-Agent",)
        )
        policy = retry or RetryPolicy()
        return cls(
            [HttpControl(i, u, session, policy, token=token, ssl=ssl) for i, u in enumerate(urls)], session=session
        )

    @classmethod
    def local(cls, shards: Sequence[Shard], coordinator: Coordinator | None = None) -> ControlClient:
        """A control client over shards in this process; `coordinator`, if
        given, is reached through shard 0 as a shard server would host it."""
        return cls([LocalControl(s, coordinator if i == 0 else None) for i, s in enumerate(shards)])

    async def declare(self, config: TableConfig) -> bool:
        """Declare a table on every shard; True if any shard created it."""
        return any(await fan_out([t.declare(config) for t in self.shards]))

    async def stats(self) -> list[Stats]:
        """Each shard's stats, in shard order."""
        return await fan_out([t.stats() for t in self.shards])

    async def report_status(self, source: str, status: WorkerStatus) -> StatusAck:
        """Leave `status` (`ps_core.store.board.as_worker_status`) on shard 0's
        status board as the latest of `source`, replacing its previous one."""
        if not isinstance(status, WorkerStatus):
            raise StatusError(f"status must be a WorkerStatus, got {type(status).__name__}")
        return await self.shards[0].report_status(source, status)

    async def statuses(self) -> list[BoardEntry]:
        """The status board of shard 0, the least recently reported source first."""
        return await self.shards[0].statuses()

    def serve_exports(self, exporter: ExportService) -> None:
        """Answer `export_now`/`exports` with an in-process exporter, as shard
        0's server does with its own (in-process deployments: ``ctrps demo``)."""
        first = self.shards[0]
        if not isinstance(first, LocalControl):
            raise ValueError("only an in-process shard 0 serves an in-process exporter")
        first.exporter = exporter
        first.moves = (self, exporter.lock)

    # -- export cuts -----------------------------------------------------------
    async def take_snapshots(self, version: int, parent: int | None) -> list[dict[str, int]]:
        """Every shard copies its rows for cut `version` (the cut's pause);
        rows per table, in shard order."""
        return await fan_out([t.take_snapshot(version, parent) for t in self.shards])

    async def fetch_snapshots(self, version: int) -> dict[int, list[TableSnapshot]]:
        """The copies of cut `version` from every shard, by shard id (once)."""
        got = await fan_out([t.fetch_snapshot(version) for t in self.shards])
        return {t.shard_id: snaps for t, snaps in zip(self.shards, got)}

    # -- the coordinator, hosted by shard 0 ------------------------------------
    async def acquire_lease(self, worker: str, wait_s: float = 5.0, ttl_s: float | None = None) -> LeaseGrant:
        """A lease for one window and the coordinator's epoch
        (`NoCoordinatorError` when shard 0 hosts none), living `ttl_s` unless
        renewed (None: the coordinator's lease TTL); `CutInProgressError`
        after `wait_s` of a cut's pause, naming what the cut waits for. Keep
        `wait_s` inside the retry deadline, so a lease granted late is never
        granted to nobody."""
        return await self.shards[0].acquire_lease(worker, wait_s, ttl_s)

    async def renew_lease(self, lease_id: int) -> bool:
        """Extend a lease by its time to live (its window still trains);
        False when it had expired."""
        return await self.shards[0].renew_lease(lease_id)

    async def sync_join(self, worker: str, model: str | None = None) -> int:
        """Sync mode: `worker` takes part in `model`'s steps (None: the
        coordinator's default model) from the open one on (at its window's
        start); returns the open step."""
        return await self.shards[0].sync_join(worker, model)

    async def sync_leave(self, worker: str, model: str | None = None) -> int:
        """Sync mode: `worker` takes no part in `model`'s steps (its window ended)."""
        return await self.shards[0].sync_leave(worker, model)

    async def sync_arrive(self, worker: str, deadline_s: float, model: str | None = None) -> int:
        """Sync mode: `worker` pushed its step of `model`; returns the step's
        number once it closed (`ps_core.checkpoint.barrier`)."""
        return await self.shards[0].sync_arrive(worker, deadline_s, model)

    async def sync_apply(self, step: int, tables: Sequence[str] | None = None) -> int:
        """Sync mode: every shard applies what its sync `tables` (a model's;
        None: all) hold for closed `step` (once, whoever asks first);
        returns the keys updated."""
        return sum(await fan_out([t.sync_apply(step, tables) for t in self.shards]))

    async def release_lease(self, lease_id: int, offsets: Offsets, **named: Unpack[ReleaseFields]) -> bool:
        """End a lease with the offsets its window committed (and the
        `ReleaseFields`); False if it had expired."""
        return await self.shards[0].release_lease(lease_id, offsets, **named)

    async def move_slots(self, request: MoveRequest) -> SlotsMoved:
        """Have shard 0's coordinator move slots (``POST /v1/slots/move``)."""
        return await self.shards[0].move_slots(request)

    async def slot_map(self) -> SlotMap:
        """The cluster's slot map, shard 0's (`ps_core.slots`): what a client
        routes by after a shard answered `moved` (`PSClient.slot_source`)."""
        body = await self.shards[0].slot_map()
        try:
            return SlotMap.from_dict(msgspec.to_builtins(body))
        except ValueError as exc:
            raise InvalidRequestError(f"shard 0's slot map: {exc}") from None

    async def coordinator_offsets(self, model: str | None = None) -> Offsets:
        """The coordinator's committed offsets of `model`: where its workers resume after a restore."""
        return await self.shards[0].coordinator_offsets(model)

    async def coordinator_resume(self, model: str | None = None) -> ResumePoint:
        """The coordinator's offsets of `model` and the stream they were read
        from (`StreamIdentity`; None when not known)."""
        return await self.shards[0].coordinator_resume(model)

    async def export_now(self, kind: str | None = None) -> ExportReportBody:
        """Cut and write a version now (`NoCoordinatorError` when shard 0 runs no exporter)."""
        return await self.shards[0].export_now(kind)

    async def exports(self, model: str | None = None) -> ExportList:
        """`model`'s versions and the last export's report, from shard 0's exporter."""
        return await self.shards[0].exports(model)

    async def compact_exports(self, model: str | None = None) -> Compaction:
        """Have shard 0's exporter fold `model`'s newest chain into a base (and prune)."""
        return await self.shards[0].compact_exports(model)

    async def drop_table(self, name: str) -> bool:
        """Drop table `name` on every shard; True if any held it."""
        return any(await fan_out([t.drop_table(name) for t in self.shards]))

    async def models(self) -> ShardModelListBody:
        """The default model and every model of the cluster (shard 0)."""
        return await self.shards[0].models()

    async def model_info(self, name: str) -> ModelEntry:
        """Model `name`'s declaration (`UnknownModelError` if the cluster has none)."""
        return await self.shards[0].model_info(name)

    async def create_model(self, body: ModelDeclaration) -> ShardModelCreatedBody:
        """Create a model from its recipe (`ps_core.checkpoint.registry.ModelSpec.recipe`):
        whether it is new, and the model."""
        return await self.shards[0].create_model(body)

    async def delete_model(self, name: str) -> ShardModelDeletedBody:
        """Delete model `name`: its tables dropped on every shard, its exports kept."""
        return await self.shards[0].delete_model(name)
