"""The shard's TCP RPC: the same binary frames as ``POST /v1/pull`` (``push``,
``push_pull``), length-prefixed on a persistent connection, with no HTTP.

A training step is one request per shard of some tens of kilobytes; with
aiohttp at both ends, HTTP cost the shard servers and the worker each about
1.4 µs per trained event more than this protocol: this is the data calls'
fast path. It carries the data operations only; everything else (tables,
stats, status, snapshots, the coordinator) stays on HTTP, which also
advertises the RPC port (``GET /healthz``: ``"rpc_port"``). Both may run
over TLS (`start_rpc_server(..., ssl=)`, `RpcConnection.open(..., ssl=)`).

Wire format (all integers little-endian):

- on connecting, the client sends ``HELLO`` (``b"ctrpsrpc"``, u32 protocol
  version, u16 token length, then the token's bytes: `ps_core.net.auth`, empty
  for none); the server answers ``b"ctrpsrpc"``, its u32 version, u32 shard
  id and u32 shard count, or closes the connection when the magic or version
  is not its own. A server with a verifier answers a missing or wrong token
  with an error reply (below) of status 401 instead, then closes; it records
  the token's scope, and answers a frame the scope does not allow (PULL needs
  read, PUSH and PUSH_PULL train) 403, keeping the connection;
- a request is a u32 body length, then the body: one `ps_core.net.codec` frame
  (PULL, PUSH or PUSH_PULL);
- a reply is a u32 payload length, a u16 status (HTTP's meaning: 200, or the
  `PSError` status), two reserved zero bytes, then the payload: the reply
  frame for 200, else the JSON error body the HTTP routes send
  (``{"error": code, "detail": reason}``).

Requests may be pipelined: the server answers them in order, one at a time
(`frame_handler.handle_frame` never suspends). A body longer than the server's limit
is answered 413 and the connection closed, since its bytes are not read.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_
import struct
from typing import NamedTuple, cast

import orjson

from ..errors import AuthError, ForbiddenError, PSError, error_from_body, http_status
from ..shard import Shard
from . import codec
from .auth import Refusals, Scope, TokenVerifier, check
from .frame_handler import handle_frame
from .limits import Occurrences, RpcLimits, listen
from .pipelined import PipelinedConnection, PipelinedProtocol, Reply, ServerConnection

__all__ = [
    "PROTOCOL_VERSION",
    "RpcConnection",
    "RpcHello",
    "RpcServerProtocol",
    "start_rpc_server",
]

log = logging.getLogger("ctrps.rpc")

MAGIC = b"ctrpsrpc"
PROTOCOL_VERSION = 2
_HELLO = struct.Struct("<8sIH")  # magic, version, token length (the token follows)
_MAX_TOKEN = 1024
_HELLO_REPLY = struct.Struct("<8sIII")
_LENGTH = struct.Struct("<I")
_REPLY = struct.Struct("<IHH")  # payload length, status, reserved
OK = 200


class RpcHello(NamedTuple):
    """What a shard's RPC server says about itself on connecting."""

    version: int
    shard_id: int
    num_shards: int


def _error_payload(code: str, detail: str) -> bytes:
    return orjson.dumps({"error": code, "detail": detail})


class _PortState:
    """What an RPC port's connections share: its limits, the bytes of frames
    announced but not yet whole (the buffer budget), and its counters."""

    def __init__(self, limits: RpcLimits) -> None:
        self.limits = limits
        self.reserved = 0
        self.refused = Occurrences(log, f"rpc: connection cap of {limits.max_connections} reached, closing new ones")
        self.hello_timeouts = Occurrences(
            log, f"rpc: closed connections that sent no hello within {limits.hello_timeout_s:g} s"
        )
        self.frame_timeouts = Occurrences(
            log, f"rpc: closed connections whose frame did not arrive within {limits.frame_timeout_s:g} s"
        )
        self.overloaded = Occurrences(
            log, f"rpc: refused frames over the {limits.buffer_budget_bytes >> 20} MiB buffer budget (503 overloaded)"
        )

    def stats(self) -> dict[str, int]:
        return {
            "buffered_frame_bytes": self.reserved,
            "refused_total": self.refused.total,
            "hello_timeouts_total": self.hello_timeouts.total,
            "frame_timeouts_total": self.frame_timeouts.total,
            "overloaded_total": self.overloaded.total,
        }


class RpcServerProtocol(ServerConnection):
    """One client connection to a shard's RPC server.

    It must greet within the hello deadline, and each frame must arrive whole
    within the frame deadline of its length prefix; a frame that does not
    arrive in one read holds its announced length of the port's buffer
    budget until it is whole, and one that would take the budget over is
    refused (503 ``overloaded``, connection closed)."""

    def __init__(
        self,
        shard: Shard,
        max_body: int,
        connections: set[ServerConnection],
        state: _PortState | None = None,
        verifier: TokenVerifier | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        super().__init__(connections)
        self._shard = shard
        self._max_body = max_body
        self._greeted = False
        self._state = state or _PortState(RpcLimits())
        self._timer: asyncio.TimerHandle | None = None
        self._reserved = 0
        """Bytes of the budget held by the frame being read (0: none)."""
        self._verifier = verifier
        self._refusals = refusals or Refusals(log)
        self._scope: Scope | None = None
        """What this connection's token grants (None: the server is open)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self._connections) >= self._state.limits.max_connections:
            self._state.refused.happened()
            cast(asyncio.Transport, transport).abort()
            return
        super().connection_made(transport)
        self._arm(self._state.limits.hello_timeout_s, self._state.hello_timeouts)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def _arm(self, seconds: float, counter: Occurrences) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, counter)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, counter: Occurrences) -> None:
        self._timer = None
        counter.happened()
        if self._transport is not None:
            self._transport.abort()

    def _release(self) -> None:
        self._state.reserved -= self._reserved
        self._reserved = 0

    def _waiting_for(self, size: int) -> bool:
        """A frame of `size` bytes is not whole yet: hold its share of the
        budget and start its deadline (once); False when it was refused."""
        if self._reserved:
            return True
        state = self._state
        if state.reserved + size > state.limits.buffer_budget_bytes:
            state.overloaded.happened()
            detail = f"the shard holds {state.reserved} bytes of unfinished frames; retry"
            self._reply(503, _error_payload("overloaded", detail))
            self.close()
            return False
        state.reserved += size
        self._reserved = size
        self._arm(state.limits.frame_timeout_s, state.frame_timeouts)
        return True

    def _peer(self) -> str:
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)

    def _greet(self, buf: bytearray) -> int:
        """Read the hello at the start of `buf`: bytes consumed, 0 while
        incomplete, -1 when the connection was refused (and closed)."""
        if len(buf) < _HELLO.size:
            return 0
        magic, version, token_len = _HELLO.unpack_from(buf, 0)
        if magic != MAGIC or version != PROTOCOL_VERSION or token_len > _MAX_TOKEN:
            log.warning("rpc: closing a connection that did not greet as a ctrps client")
            self.close()
            return -1
        end = _HELLO.size + int(token_len)
        if len(buf) < end:
            return 0
        reason, self._scope = check(self._verifier, bytes(buf[_HELLO.size : end]), Scope.READ)
        if reason:
            self._refusals.refuse(reason, plane="rpc", peer=self._peer(), what="hello", needs=Scope.READ)
            self._reply(
                401,
                orjson.dumps(
                    {
                        "error": "unauthorized",
                        "detail": (
                            "no token presented in the hello"
                            if reason == "missing"
                            else "the token presented is not valid for this cluster"
                        ),
                    }
                ),
            )
            self.close()
            return -1
        spec = self._shard.spec
        assert self._transport is not None
        self._transport.write(_HELLO_REPLY.pack(MAGIC, PROTOCOL_VERSION, spec.shard_id, spec.num_shards))
        self._greeted = True
        self._disarm()
        return end

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        transport = self._transport
        start = 0
        try:
            if not self._greeted:
                start = self._greet(buf)
                if start <= 0:
                    start = len(buf) if start < 0 else 0
                    return
            # Every whole request in the buffer, in order.
            while transport is not None and len(buf) - start >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(buf, start)
                if size > self._max_body:
                    detail = f"request of {size} bytes over the {self._max_body}-byte limit"
                    self._reply(http_status("too_large"), _error_payload("too_large", detail))
                    self.close()
                    start = len(buf)
                    return
                end = start + _LENGTH.size + size
                if len(buf) < end:
                    if not self._waiting_for(size):
                        start = len(buf)
                        return
                    break
                if self._reserved:
                    self._release()
                    self._disarm()
                # A copy: the frame's arrays are views of it, and `buf` moves on.
                body = bytes(memoryview(buf)[start + _LENGTH.size : end])
                start = end
                self._handle(body)
        finally:
            del buf[:start]

    def _handle(self, body: bytes) -> None:
        if self._scope is not None:
            # A pull reads, all else trains: checked before the frame is decoded.
            op = codec.op_of(body)
            needs = Scope.READ if op == codec.Op.PULL else Scope.TRAIN
            if self._scope < needs:
                self._refusals.refuse("scope", plane="rpc", peer=self._peer(), what=f"frame op {op}", needs=needs)
                detail = f"this call needs a token of scope {needs.label}, the one presented is {self._scope.label}"
                self._reply(ForbiddenError.status, _error_payload("forbidden", detail))
                return
        try:
            reply = handle_frame(self._shard, body)
        except PSError as exc:
            self._reply(exc.status, orjson.dumps(exc.to_body()))
            return
        except Exception as exc:  # a bug must not drop the other requests of the connection
            log.exception("rpc: request failed")
            self._reply(http_status("internal"), _error_payload("internal", repr(exc)))
            return
        self._reply(OK, reply)

    def _reply(self, status: int, payload: bytes) -> None:
        if self._transport is not None:
            self._transport.writelines([_REPLY.pack(len(payload), status, 0), payload])


class RpcServer:
    """A shard's RPC server; `close` stops listening and closes every connection."""

    def __init__(
        self, server: asyncio.Server, connections: set[ServerConnection], state: _PortState | None = None
    ) -> None:
        self._server = server
        self._connections = connections
        self._state = state or _PortState(RpcLimits())
        sockets = server.sockets or ()
        self.port: int = sockets[0].getsockname()[1] if sockets else 0
        """The port it listens on (the one the OS chose when asked for 0)."""

    def stats(self) -> dict[str, int]:
        """The port's open connections, buffered frame bytes and counters (for the metrics)."""
        return {"open_connections": len(self._connections), **self._state.stats()}

    async def close(self) -> None:
        self._server.close()
        for conn in list(self._connections):
            conn.close()
        await self._server.wait_closed()


async def start_rpc_server(
    shard: Shard,
    host: str,
    port: int,
    *,
    max_body: int,
    limits: RpcLimits | None = None,
    verifier: TokenVerifier | None = None,
    refusals: Refusals | None = None,
    ssl: ssl_.SSLContext | None = None,
) -> RpcServer:
    """Serve `shard`'s pulls and pushes on `host`:`port` (0 picks a free port)
    under `limits` (connections, deadlines, the buffer budget).

    With `verifier`, each connection's hello must carry a token (of read
    scope at least; train to push), refusals counted in `refusals` (shared
    with the HTTP app's, see `ps_core.net.server.create_shard_app`); with `ssl`,
    a server context, connections are TLS."""
    connections: set[ServerConnection] = set()
    state = _PortState(limits or RpcLimits())
    refusals = refusals or Refusals(log)
    # A TLS handshake is part of the hello: it shares its deadline.
    server = await listen(
        lambda: RpcServerProtocol(shard, max_body, connections, state, verifier, refusals),
        host,
        port,
        ssl,
        max_connections=state.limits.max_connections,
        handshake_timeout_s=state.limits.hello_timeout_s,
    )
    return RpcServer(server, connections, state)


class _ClientProtocol(PipelinedProtocol):
    """Reads the greeting, then replies, matched to the waiting calls in order."""

    def __init__(self) -> None:
        super().__init__()
        self.hello: asyncio.Future[RpcHello] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.hello.done():
            assert self.lost is not None
            self.hello.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        if not self.hello.done():
            if len(buf) >= _REPLY.size and buf[: len(MAGIC)] != MAGIC:
                # An error reply instead of the greeting: the token was refused.
                size, status, reserved = _REPLY.unpack_from(buf, 0)
                if not (400 <= status < 600 and reserved == 0 and size <= 1 << 16):
                    self.hello.set_exception(ConnectionError(f"not a ctrps RPC server of version {PROTOCOL_VERSION}"))
                    self.fail("not a ctrps RPC server")
                    return
                if len(buf) < _REPLY.size + size:
                    return
                body = bytes(buf[_REPLY.size : _REPLY.size + size])
                try:
                    err: Exception = error_from_body(status, orjson.loads(body))
                except orjson.JSONDecodeError:
                    err = ConnectionError(f"not a ctrps RPC server of version {PROTOCOL_VERSION}")
                self.hello.set_exception(err)
                self.fail(str(err))
                return
            if len(buf) < _HELLO_REPLY.size:
                return
            magic, version, shard_id, num_shards = _HELLO_REPLY.unpack_from(buf, 0)
            start = _HELLO_REPLY.size
            if magic != MAGIC or version != PROTOCOL_VERSION:
                self.hello.set_exception(
                    ConnectionError(f"not a ctrps RPC server of version {PROTOCOL_VERSION} ({magic!r}, {version})")
                )
                self.fail("not a ctrps RPC server")
                return
            self.hello.set_result(RpcHello(version, shard_id, num_shards))
        while len(buf) - start >= _REPLY.size:
            size, status, _ = _REPLY.unpack_from(buf, start)
            end = start + _REPLY.size + size
            if len(buf) < end:
                break
            payload = bytes(memoryview(buf)[start + _REPLY.size : end])
            start = end
            if not self.deliver(status, payload):
                return  # out of step: dropped
        del buf[:start]


class RpcConnection(PipelinedConnection):
    """A client's connection to one shard's RPC server; calls may overlap."""

    def __init__(self, protocol: _ClientProtocol, hello: RpcHello) -> None:
        super().__init__(protocol)
        self.hello = hello

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> RpcConnection:
        """Connect and greet with `token` (over TLS with `ssl`, a client
        context, verifying the server as `server_hostname`, default `host`).

        Raises `ps_core.errors.AuthError` when the server refuses the token
        (a configuration error: not worth retrying), OSError (or
        ConnectionError, ssl.SSLError) when connecting fails."""
        raw = token.encode("utf-8")
        if len(raw) > _MAX_TOKEN:
            raise AuthError(f"a token of {len(raw)} bytes is over the RPC's {_MAX_TOKEN}-byte limit")
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_connection(
            _ClientProtocol, host, port, ssl=ssl, server_hostname=(server_hostname or host) if ssl else None
        )
        transport.write(_HELLO.pack(MAGIC, PROTOCOL_VERSION, len(raw)) + raw)
        try:
            hello = await protocol.hello
        except BaseException:
            transport.abort()
            raise
        return cls(protocol, hello)

    def call(self, path: str, body: bytes, timeout_s: float | None = None) -> asyncio.Future[Reply]:
        """Send one request; the future gets (status, payload), a
        ConnectionError, or a TimeoutError after `timeout_s`.

        `path`, the HTTP route of the same call, is not sent: the frame's op
        says what it is."""
        return self._send((_LENGTH.pack(len(body)), body), timeout_s)
