"""How a client reaches one shard's data plane: pulls and pushes.

`ShardReader` is the read side (pull, pull_versioned): all that serving
needs, and all a serving replica has. `ShardTransport` adds the writes (push,
push_pull). Implementations: `LocalTransport` (a `Shard` in this process, no
encoding), `HttpTransport` (binary frames over aiohttp: the fallback) and
`TcpTransport` (the same frames over the shard's TCP RPC, `ps_core.net.rpc`:
the fast path and the default). Everything else a shard answers (tables,
stats, the status board, snapshots, leases, exports) is the control plane's
(`ps_core.checkpoint.control`).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..errors import FrameError, error_from_body
from ..hashing import U64
from ..store.table import F32
from . import codec
from .endpoint import RETRIED_STATUSES, Backoff, ShardEndpoint, json_or_text, not_joined, retried_reason
from .rpc import RpcConnection
from .server import FRAME_CONTENT_TYPE
from .shard import Push, Shard

__all__ = ["Push", "Pulled", "ShardReader", "ShardTransport", "LocalTransport", "HttpTransport", "TcpTransport"]


@dataclass(frozen=True)
class Pulled:
    """The answer of `PSClient.pull_versioned` (or of one shard to it)."""

    weights: F32
    """(n, dim) weights, in the order of the keys asked for."""
    version: int
    """The table's open export version (the smallest over the shards asked)."""
    present: npt.NDArray[np.bool_] | None
    """(n,) whether each key has a row (absent keys read their initial
    value); None unless presence was asked for."""
    clock: int = 0
    """The table's clock at the read (`ps_core.store.staleness`; 0: unknown)."""


class ShardReader(Protocol):
    """How a reader reaches one shard: weights only, no writes."""

    shard_id: int

    async def pull(self, table: str, keys: U64) -> F32: ...

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled: ...

    async def close(self) -> None: ...


class ShardTransport(ShardReader, Protocol):
    """How a trainer reaches one shard: reads, and pushes of gradients."""

    async def push(self, push: Push) -> int: ...

    async def push_pull(self, push: Push, pull_keys: U64) -> tuple[int, F32, int]:
        """(distinct keys applied, the pull's weights, the table's clock at the read)."""
        ...


class LocalTransport:
    """A shard in this process: handlers called directly, no copies or frames."""

    def __init__(self, shard: Shard, *, routed: bool = False) -> None:
        """`routed`: every key reaching this transport was split by `shard_of`
        for the shard's own spec (`PSClient.local` sets it when the shards'
        specs match their places), so the shard skips re-hashing pulled and
        pushed keys to check that it owns them (~15 us per call)."""
        self.shard = shard
        self.shard_id = shard.spec.shard_id
        self.routed = routed

    async def pull(self, table: str, keys: U64) -> F32:
        return self.shard.handle_pull(table, keys, owned=self.routed)[0]

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled:
        weights, version = self.shard.handle_pull(table, keys, owned=self.routed)
        present = self.shard.contains(table, keys) if presence else None
        return Pulled(weights, version, present, self.shard.tables[table].clock)

    async def push(self, push: Push) -> int:
        return self.shard.handle_push(push, owned=self.routed)[0]

    async def push_pull(self, push: Push, pull_keys: U64) -> tuple[int, F32, int]:
        applied, weights, _ = self.shard.handle_push_pull(push, pull_keys, owned=self.routed)
        return applied, weights, self.shard.tables[push.table].clock

    async def close(self) -> None:
        return None


class FrameConnection(Protocol):
    """A persistent connection carrying frame calls, pipelined and answered
    in order (`ps_core.net.rpc.RpcConnection`)."""

    @property
    def is_open(self) -> bool: ...

    def call(self, path: str, body: bytes, timeout_s: float | None = None) -> asyncio.Future[tuple[int, bytes]]: ...

    def abort(self) -> None: ...

    async def close(self) -> None: ...


class HttpTransport(ShardEndpoint):
    """A shard server reached over HTTP keep-alive (aiohttp) with binary frames.

    Every call goes through the aiohttp session, retried as
    `ShardEndpoint.request` retries (a retried push keeps its request id).
    """

    # Per instance once set: the frame connection and the lock that opens it.
    _conn: FrameConnection | None = None
    _opening: asyncio.Lock | None = None

    async def _open(self) -> FrameConnection | None:
        """A new connection for frame calls; None to send them through aiohttp."""
        return None

    async def _connection(self) -> FrameConnection | None:
        """The open frame connection (opened if needed), or None for aiohttp."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._conn is None or not self._conn.is_open:
                self._conn = await self._open()
            return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
        self._conn = None

    async def _frame_request(self, path: str, body: bytes) -> bytes:
        """A frame's round trip: POSTed to `path`, the reply frame back."""
        backoff = Backoff(self._retry)
        while True:
            try:
                conn = self._conn
                if conn is None or not conn.is_open:
                    conn = await self._connection()
                    if conn is None:
                        _, reply = await self.request("POST", path, body, FRAME_CONTENT_TYPE)
                        return reply
                status, payload = await conn.call(path, body, backoff.remaining())
            except ssl_.SSLCertVerificationError as exc:
                raise self._unverified(exc) from None
            except (TimeoutError, OSError) as exc:  # ConnectionError is an OSError
                last = f"{type(exc).__name__}: {exc}"
                # A timed-out call's reply may still come: drop the connection
                # so that no later call reads it as its own.
                self._drop()
            else:
                if status < 400:
                    return payload
                reply_body = json_or_text(payload)
                if status not in RETRIED_STATUSES or not_joined(reply_body):
                    # A shard waiting to be admitted is not retried: a push
                    # held back until after a cluster restore would land on
                    # the restored state, and its window is replayed anyway.
                    raise error_from_body(status, reply_body)
                last = retried_reason(status, payload)
            await backoff.failed(last, self._unavailable)

    async def pull(self, table: str, keys: U64) -> F32:
        reply = await self._frame_request("/v1/pull", codec.encode_pull(table, keys))
        frame = codec.decode(reply, codec.Op.WEIGHTS)
        assert frame.values is not None
        return frame.values

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled:
        body = codec.encode_pull(table, keys, presence=presence)
        reply = await self._frame_request("/v1/pull", body)
        frame = codec.decode(reply, codec.Op.WEIGHTS)
        assert frame.values is not None
        if presence and frame.present is None:
            raise FrameError(f"shard {self.shard_id} answered a presence pull without presence")
        return Pulled(frame.values, frame.version, frame.present, frame.clock)

    async def push(self, push: Push) -> int:
        table, keys, grads, counts, event_time, request_id, base_clock = push
        body = codec.encode_push(
            table, keys, grads, counts=counts, event_time=event_time, request_id=request_id, base_clock=base_clock
        )
        reply = await self._frame_request("/v1/push", body)
        return codec.decode(reply, codec.Op.ACK).count

    async def push_pull(self, push: Push, pull_keys: U64) -> tuple[int, F32, int]:
        table, keys, grads, counts, event_time, request_id, base_clock = push
        body = codec.encode_push_pull(
            table,
            keys,
            grads,
            pull_keys,
            counts=counts,
            event_time=event_time,
            request_id=request_id,
            base_clock=base_clock,
        )
        # Retried like a push, with the same body and so the same request id:
        # a shard that applied the push answers the pull without applying again.
        reply = await self._frame_request("/v1/push_pull", body)
        frame = codec.decode(reply, codec.Op.PUSH_PULL_REPLY)
        assert frame.values is not None
        if frame.count != pull_keys.size:
            raise FrameError(f"shard {self.shard_id} answered {frame.count} rows for {pull_keys.size} pull keys")
        return frame.applied, frame.values, frame.clock

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


class TcpTransport(HttpTransport):
    """A shard server whose pulls and pushes travel over its TCP RPC
    (`ps_core.net.rpc`: the same frames, no HTTP).

    The RPC port is read from the shard's ``GET /healthz`` on first use and
    again after a connection fails (a restarted shard may listen on another).
    A shard that advertises none is reached over HTTP alone. Calls share one
    connection (pipelined) and are retried as `HttpTransport` retries them.
    """

    # Per instance once set (class-level until then: no __init__ of its own).
    rpc_port: int | None = None
    """The shard's RPC port, once read from its ``/healthz``."""
    uses_rpc: bool | None = None
    """Whether data calls go over the RPC (None until the shard was asked)."""

    def _via(self) -> str:
        return " (rpc)" if self.uses_rpc else ""

    async def _open(self) -> FrameConnection | None:
        if self.uses_rpc is False:
            return await super()._open()
        if self.rpc_port is None:
            _, reply = await self.request("GET", "/healthz")
            health = json_or_text(reply)
            port = health.get("rpc_port") if isinstance(health, dict) else None
            if not isinstance(port, int) or isinstance(port, bool):
                self.uses_rpc = False
                return await super()._open()
            self.rpc_port = port
        # The RPC of an https:// shard is TLS too, verified the same way.
        tls = None
        if self._tls:
            tls = self._ssl if isinstance(self._ssl, ssl_.SSLContext) else ssl_.create_default_context()
        conn = await RpcConnection.open(
            self._host, self.rpc_port, token=self._token, ssl=tls, server_hostname=self._host
        )
        self.uses_rpc = True
        return conn

    def _drop(self) -> None:
        super()._drop()
        if self.uses_rpc:
            self.rpc_port = None
