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
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np
import numpy.typing as npt

from ..errors import FrameError, FrameVersionError, KeySetExpiredError, error_from_body
from ..hashing import U64
from ..shard import Push, Shard
from ..slots import SlotMap
from ..store.change_log import Changes
from ..store.storage import F32
from . import codec, op_encoders
from .endpoint import (
    RETRIED_STATUSES,
    Backoff,
    RetryPolicy,
    ShardEndpoint,
    json_or_text,
    not_joined,
    retried_reason,
)
from .quantize import Quantized, quantize
from .rpc import RpcConnection
from .server import FRAME_CONTENT_TYPE
from .wire import F32_WIRE, ErrorFeedback, WireFormat, WireStats

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

    @property
    def key_sets(self) -> bool:
        """Whether this transport's pulls may be remembered (`remember`)."""
        ...

    async def pull(self, table: str, keys: U64) -> F32: ...

    async def pull_versioned(self, table: str, keys: U64, presence: bool, remember: int = 0) -> Pulled:
        """`remember`: an id under which a shard server that keeps key sets
        (`key_sets`) keeps these keys for the push that names them."""
        ...

    async def close(self) -> None: ...


class ShardTransport(ShardReader, Protocol):
    """How a trainer reaches one shard: reads, and pushes of gradients."""

    async def push(self, push: Push) -> int: ...

    async def push_pull(self, push: Push, pull_keys: U64, remember: int = 0) -> tuple[int, F32, int]:
        """(distinct keys applied, the pull's weights, the table's clock at
        the read); `remember` as for `pull_versioned`."""
        ...

    async def changes(self, table: str, since: int, incarnation: int, own: U64) -> Changes:
        """A geo table's keys changed after `since` (of the change log's
        `incarnation`) but by the pushes with request ids `own`
        (`ps_core.store.change_log`)."""
        ...


class RoutedBy(Protocol):
    """What splits the keys a `LocalTransport` gets: a client's slot map."""

    @property
    def slot_map(self) -> SlotMap: ...


class LocalTransport:
    """A shard in this process: handlers called directly, no copies or frames."""

    def __init__(self, shard: Shard, *, routed_by: RoutedBy | None = None) -> None:
        """`routed_by`: the client whose slot map splits every key reaching
        this transport (`PSClient.local` gives it when the shards' specs match
        their places). While its map is the shard's own (the same epoch), the
        shard skips re-hashing pulled and pushed keys to check that it owns
        them (~15 us per call)."""
        self.shard = shard
        self.shard_id = shard.spec.shard_id
        self.routed_by = routed_by
        self.key_sets = False  # no frames: pushes carry their keys as they are

    @property
    def routed(self) -> bool:
        """Whether keys split now are split by the shard's own slot map."""
        by = self.routed_by
        return by is not None and by.slot_map.epoch == self.shard.slot_map.epoch

    def _split_at(self) -> int:
        """The epoch of the map the keys of a call made now were split by (0:
        not split by a client of this transport): read when the call is made
        (the client splits by its current map just before), and compared with
        the shard's when it runs, since a move may come in between."""
        by = self.routed_by
        return 0 if by is None else by.slot_map.epoch

    def _owned(self, split_at: int) -> bool:
        return split_at != 0 and split_at == self.shard.slot_map.epoch

    def pull(self, table: str, keys: U64) -> Coroutine[Any, Any, F32]:
        return self._pull(table, keys, self._split_at())

    async def _pull(self, table: str, keys: U64, split_at: int) -> F32:
        return self.shard.handle_pull(table, keys, owned=self._owned(split_at))[0]

    def pull_versioned(self, table: str, keys: U64, presence: bool, remember: int = 0) -> Coroutine[Any, Any, Pulled]:
        return self._pull_versioned(table, keys, presence, self._split_at())

    async def _pull_versioned(self, table: str, keys: U64, presence: bool, split_at: int) -> Pulled:
        weights, version = self.shard.handle_pull(table, keys, owned=self._owned(split_at))
        present = self.shard.contains(table, keys) if presence else None
        return Pulled(weights, version, present, self.shard.tables[table].clock)

    def push(self, push: Push) -> Coroutine[Any, Any, int]:
        return self._push(push, self._split_at())

    async def _push(self, push: Push, split_at: int) -> int:
        return self.shard.handle_push(push, owned=self._owned(split_at))[0]

    def push_pull(self, push: Push, pull_keys: U64, remember: int = 0) -> Coroutine[Any, Any, tuple[int, F32, int]]:
        return self._push_pull(push, pull_keys, self._split_at())

    async def _push_pull(self, push: Push, pull_keys: U64, split_at: int) -> tuple[int, F32, int]:
        applied, weights, _ = self.shard.handle_push_pull(push, pull_keys, owned=self._owned(split_at))
        return applied, weights, self.shard.tables[push.table].clock

    async def changes(self, table: str, since: int, incarnation: int, own: U64) -> Changes:
        return self.shard.handle_changes(table, since, incarnation, own.tolist())

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
    Frames travel in the transport's `wire` format (`ps_core.net.wire`);
    `wire_stats` counts what they cost.
    """

    def __init__(
        self,
        shard_id: int,
        url: str,
        session: aiohttp.ClientSession,
        retry: RetryPolicy,
        *,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
        wire: WireFormat = F32_WIRE,
    ) -> None:
        super().__init__(shard_id, url, session, retry, token=token, ssl=ssl)
        self.wire = wire
        self.wire_stats = WireStats()
        self._rng = np.random.default_rng()
        self._feedback: dict[str, ErrorFeedback] = {}

    @property
    def key_sets(self) -> bool:
        """Whether pulls are remembered for the pushes that follow."""
        return self.wire.key_sets

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
        stats = self.wire_stats
        stats.frames += 1
        stats.bytes_sent += len(body)
        backoff = Backoff(self._retry)
        while True:
            try:
                conn = self._conn
                if conn is None or not conn.is_open:
                    conn = await self._connection()
                    if conn is None:
                        try:
                            _, reply = await self.request("POST", path, body, FRAME_CONTENT_TYPE)
                        except FrameError as exc:
                            raise _newer_format(exc, self.shard_id) from None
                        stats.bytes_received += len(reply)
                        return reply
                status, payload = await conn.call(path, body, backoff.remaining())
                stats.bytes_received += len(payload)
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
                    raise _newer_format(error_from_body(status, reply_body), self.shard_id)
                last = retried_reason(status, payload)
            await backoff.failed(last, self._unavailable)

    async def pull(self, table: str, keys: U64) -> F32:
        return (await self.pull_versioned(table, keys, False)).weights

    async def pull_versioned(self, table: str, keys: U64, presence: bool, remember: int = 0) -> Pulled:
        wire = self.wire
        body = op_encoders.encode_pull(
            table, keys, presence=presence, reply_vtype=wire.pull_type, remember=remember if wire.key_sets else 0
        )
        reply = await self._frame_request("/v1/pull", body)
        frame = codec.decode(reply, codec.Op.WEIGHTS)
        assert frame.values is not None
        if presence and frame.present is None:
            raise FrameError(f"shard {self.shard_id} answered a presence pull without presence")
        return Pulled(frame.values, frame.version, frame.present, frame.clock)

    async def push(self, push: Push) -> int:
        grads, dim = self._push_values(push)
        ref = push.keys_ref if self.wire.key_sets and push.keys.size else 0
        body = self._push_body(push, grads, dim, ref)
        reply = await self._keyed_request("/v1/push", body, push, grads, dim, None, 0)
        return codec.decode(reply, codec.Op.ACK).count

    async def push_pull(self, push: Push, pull_keys: U64, remember: int = 0) -> tuple[int, F32, int]:
        grads, dim = self._push_values(push)
        ref = push.keys_ref if self.wire.key_sets and push.keys.size else 0
        remember = remember if self.wire.key_sets else 0
        body = self._push_body(push, grads, dim, ref, pull_keys, remember)
        # Retried like a push, with the same body and so the same request id:
        # a shard that applied the push answers the pull without applying again.
        reply = await self._keyed_request("/v1/push_pull", body, push, grads, dim, pull_keys, remember)
        frame = codec.decode(reply, codec.Op.PUSH_PULL_REPLY)
        assert frame.values is not None
        if frame.count != pull_keys.size:
            raise FrameError(f"shard {self.shard_id} answered {frame.count} rows for {pull_keys.size} pull keys")
        return frame.applied, frame.values, frame.clock

    async def changes(self, table: str, since: int, incarnation: int, own: U64) -> Changes:
        reply = await self._frame_request("/v1/changes", op_encoders.encode_changes(table, since, incarnation, own))
        frame = codec.decode(reply, codec.Op.CHANGES_REPLY)
        assert frame.keys is not None
        return Changes(frame.keys, frame.complete, frame.clock, frame.incarnation)

    def _push_values(self, push: Push) -> tuple[F32 | Quantized, int]:
        """The push's gradients in the wire's value type, once per push (a
        push sent again keeps them: error feedback must not count twice)."""
        g = push.grads
        dim = int(g.shape[1]) if g.ndim == 2 else 1
        wire = self.wire
        if wire.push == "f32":
            return g, dim
        if wire.rounding == "feedback":
            fb = self._feedback.get(push.table)
            if fb is None:
                fb = self._feedback[push.table] = ErrorFeedback(wire.feedback_rows)
            q = fb.quantize(push.keys, g, wire.push_type)
        else:
            q = quantize(g, wire.push_type, "stochastic", self._rng)
        self.wire_stats.values_clipped += q.clipped
        return q, dim

    def _push_body(
        self,
        push: Push,
        grads: F32 | Quantized,
        dim: int,
        keys_ref: int,
        pull_keys: U64 | None = None,
        remember: int = 0,
    ) -> bytes:
        wire = self.wire
        if keys_ref:
            self.wire_stats.key_set_pushes += 1
        common: op_encoders.PushFields = {
            "counts": push.counts,
            "event_time": push.event_time,
            "request_id": push.request_id,
            "base_clock": push.base_clock,
            "dim": dim,
            "keys_ref": keys_ref,
            "compact": wire.compact_counts,
        }
        if pull_keys is None:
            return op_encoders.encode_push(push.table, push.keys, grads, **common)
        return op_encoders.encode_push_pull(
            push.table,
            push.keys,
            grads,
            pull_keys,
            reply_vtype=wire.pull_type,
            remember=bool(remember),
            **common,
        )

    async def _keyed_request(
        self,
        path: str,
        body: bytes,
        push: Push,
        grads: F32 | Quantized,
        dim: int,
        pull_keys: U64 | None,
        remember: int,
    ) -> bytes:
        """`body`'s round trip; a push naming a key set the shard no longer
        holds (nothing applied) is sent again with its keys."""
        try:
            return await self._frame_request(path, body)
        except KeySetExpiredError:
            if not (self.wire.key_sets and push.keys_ref):
                raise
            self.wire_stats.key_set_misses += 1
            return await self._frame_request(path, self._push_body(push, grads, dim, 0, pull_keys, remember))

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def _newer_format(err: Exception, shard_id: int) -> Exception:
    """A shard's refusal of a frame's format version (a shard older than
    format 2: its code is the plain ``bad_frame``) as `FrameVersionError`,
    saying what to change; any other error as it is."""
    if isinstance(err, FrameError) and "unsupported frame format version" in err.detail:
        return FrameVersionError(
            f"shard {shard_id}: {err.detail}: upgrade the shards, or run the worker with --wire-push f32 "
            "--wire-pull f32 --no-key-sets --no-compact-counts (frame format 1)"
        )
    return err


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
