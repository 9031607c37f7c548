"""The shard's HTTP port: the frame routes served directly, the rest by aiohttp.

A training step is one ``POST /v1/push_pull`` per shard, and aiohttp's server
spends about 115 µs of Python on each: over a microsecond per trained event
of a shard server's core at 256-event mini-batches, as much again as the
TCP RPC (`ps_core.rpc`) costs. `start_shard_http` listens on the HTTP port
with `FrameFront`, a protocol that answers the simplest form of the three
frame routes itself and hands every other request, with its connection, to
the aiohttp application (`ps_core.server.create_shard_app`), which then
serves the connection to its end.

Served here: ``POST /v1/pull``, ``/v1/push`` or ``/v1/push_pull``, HTTP/1.1,
a body framed by one ``Content-Length`` and no ``Transfer-Encoding``
or ``Expect``. Anything else (another route or method, a chunked body, a
malformed head) goes to aiohttp from that request on, so every request is
answered by the rules of one of the two servers, and the two answer frame
requests alike: the reply frame (200, ``application/x-ctrps-frame``), the
`PSError`'s status with its JSON body, 500 ``internal`` for a bug, and 413
``too_large`` for a body over the limit (its bytes are not read: the
connection is closed after the reply). Requests may be pipelined; each is
answered in order as it completes (`Shard.handle_frame` never suspends).
Connections idle for `keepalive_s` are closed, as aiohttp closes its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from typing import Callable, cast

import orjson
from aiohttp import web

from . import codec
from .errors import PSError
from .pipelined import ServerConnection
from .server import FRAME_CONTENT_TYPE
from .shard import Shard

__all__ = ["FrameFront", "ShardHttpServer", "start_shard_http"]

log = logging.getLogger("ctrps.http")

_ROUTES = {b"/v1/pull": codec.Op.PULL, b"/v1/push": codec.Op.PUSH, b"/v1/push_pull": codec.Op.PUSH_PULL}
_MAX_HEAD = 16 * 1024
"""A longer head is left to aiohttp (which refuses heads over 8 KiB lines)."""
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 409: b"Conflict",
            413: b"Request Entity Too Large", 500: b"Internal Server Error", 503: b"Service Unavailable"}
_FRAME_TYPE = FRAME_CONTENT_TYPE.encode("ascii")
_ERROR_TYPE = b"application/json"  # what the app sends for the same errors


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value


_DATE = _Date()


def _json_error(code: str, detail: str) -> bytes:
    return orjson.dumps({"error": code, "detail": detail})


class FrameFront(ServerConnection):
    """One connection to the shard's HTTP port (see the module docstring)."""

    def __init__(
        self,
        shard: Shard,
        max_body: int,
        fallback: Callable[[], asyncio.Protocol],
        connections: set[ServerConnection],
    ) -> None:
        super().__init__(connections)
        self._shard = shard
        self._max_body = max_body
        self._fallback = fallback
        self.last_active = 0.0
        """`loop.time()` of the last bytes received, for the idle timeout."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.last_active = asyncio.get_running_loop().time()

    def data_received(self, data: bytes) -> None:
        self.last_active = asyncio.get_running_loop().time()
        buf = self._buf
        buf += data
        start = 0
        try:
            while self._transport is not None:
                end = buf.find(b"\r\n\r\n", start)
                if end < 0:
                    if len(buf) - start > _MAX_HEAD:
                        self._hand_off(start)
                        start = len(buf)
                    return
                head = _parse_head(bytes(buf[start:end]))
                if head is None:
                    self._hand_off(start)
                    start = len(buf)
                    return
                op, length, keep_alive = head
                if length > self._max_body:
                    detail = f"request of {length} bytes over the {self._max_body}-byte limit"
                    self._reply(413, _json_error("too_large", detail), _ERROR_TYPE, False)
                    self._transport.close()
                    start = len(buf)
                    return
                body_at = end + 4
                if len(buf) - body_at < length:
                    return  # the body is still arriving
                # A copy: the frame's arrays are views of it, and `buf` moves on.
                body = bytes(memoryview(buf)[body_at : body_at + length])
                start = body_at + length
                self._handle(body, op, keep_alive)
                if not keep_alive:
                    self._transport.close()
                    start = len(buf)
                    return
        finally:
            del buf[:start]

    def _hand_off(self, start: int) -> None:
        """Give the connection, from the request at `start` on, to aiohttp."""
        transport = self._transport
        assert transport is not None
        self._connections.discard(self)
        self._transport = None
        rest = bytes(self._buf[start:])
        handler = self._fallback()
        # Reading may be paused by `pause_writing`: the app is not told of
        # that pause, so it must not inherit it (resuming is idempotent).
        transport.resume_reading()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if rest:
            handler.data_received(rest)

    def _handle(self, body: bytes, op: int, keep_alive: bool) -> None:
        try:
            reply = self._shard.handle_frame(body, expect_op=op)
        except PSError as exc:
            self._reply(exc.status, orjson.dumps(exc.to_body()), _ERROR_TYPE, keep_alive)
            return
        except Exception as exc:  # a bug must not drop the other requests of the connection
            log.exception("http: frame request failed")
            self._reply(500, _json_error("internal", repr(exc)), _ERROR_TYPE, keep_alive)
            return
        self._reply(200, reply, _FRAME_TYPE, keep_alive)

    def _reply(self, status: int, payload: bytes, content_type: bytes, keep_alive: bool) -> None:
        if self._transport is None:
            return
        head = b"".join((
            b"HTTP/1.1 ", str(status).encode("ascii"), b" ", _REASONS.get(status, b"Error"),
            b"\r\nContent-Type: ", content_type,
            b"\r\nContent-Length: ", str(len(payload)).encode("ascii"),
            b"\r\nDate: ", _DATE.now(),
            b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n",
        ))
        self._transport.writelines((head, payload))


def _parse_head(head: bytes) -> tuple[int, int, bool] | None:
    """(op, body length, keep-alive) of a frame request this front serves,
    or None for any request it leaves to aiohttp."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST":
        return None
    op = _ROUTES.get(parts[1])
    if op is None or parts[2] != b"HTTP/1.1":
        return None  # (HTTP/1.0's keep-alive rules are aiohttp's to apply)
    length: int | None = None
    keep_alive = True
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None  # malformed (RFC 9112 §5.1: no space before the colon)
        name = name.lower()
        value = value.strip()
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name in (b"transfer-encoding", b"expect"):
            return None
        elif name == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    if length is None:
        return None
    return op, length, keep_alive


class ShardHttpServer:
    """The shard's HTTP port: `FrameFront` over an aiohttp runner; `cleanup`
    stops listening and closes every connection."""

    def __init__(
        self, server: asyncio.Server, runner: web.AppRunner, connections: set[ServerConnection], sweeper: asyncio.Task[None]
    ) -> None:
        self._server = server
        self._runner = runner
        self._connections = connections
        self._sweeper = sweeper
        sockets = server.sockets or ()
        self.port: int = sockets[0].getsockname()[1] if sockets else 0
        """The port it listens on (the one the OS chose when asked for 0)."""

    async def cleanup(self) -> None:
        """Stop listening, close the front's connections, then clean up the
        aiohttp runner (which closes the connections handed to it). Safe to
        call more than once."""
        if self._sweeper.done():
            return
        self._sweeper.cancel()
        self._server.close()
        for conn in list(self._connections):
            conn.close()
        await self._runner.cleanup()
        await self._server.wait_closed()


async def start_shard_http(
    runner: web.AppRunner, shard: Shard, host: str, port: int, *, max_body: int, keepalive_s: float = 75.0
) -> ShardHttpServer:
    """Serve `shard`'s HTTP port on `host`:`port` (0 picks a free port): frame
    requests by `FrameFront`, the rest by `runner`'s application (set up)."""
    fallback = runner.server
    if fallback is None:
        raise RuntimeError("the runner is not set up")
    connections: set[ServerConnection] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FrameFront(shard, max_body, fallback, connections), host, port, reuse_address=True
    )

    async def sweep() -> None:
        # One timer for all connections, instead of one per request.
        while True:
            await asyncio.sleep(max(keepalive_s / 4, 0.01))
            idle_since = loop.time() - keepalive_s
            for conn in [c for c in connections if cast(FrameFront, c).last_active < idle_since]:
                conn.close()

    return ShardHttpServer(server, runner, connections, asyncio.create_task(sweep()))
