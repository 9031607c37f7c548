"""Limits on every port: how many connections, and how long a peer may take.

A server that waits for a peer without a deadline is a server a few idle
sockets can exhaust: aiohttp times out neither a connection that never sends
its request head nor a body that never comes (a chunk announced as
``ffffffff``, then silence), and the RPC buffered whatever frame length a
peer announced. Here each port gets:

- a cap on concurrent connections: over it, a new connection is closed at
  once (one warning line when the cap is reached, a count every time);
- a head deadline: a request's head must arrive within `header_timeout_s` of
  the connection opening, and the next one within `idle_timeout_s` of the
  previous response (keep-alive);
- a body deadline: a request's body must arrive within `body_timeout_s` of
  its head (408 otherwise; the body is read before the handler runs, so
  every handler gets it whole);
- aiohttp's own sizes: the longest head line and header field.

`PortGuard` holds one port's limits and counters; `serve_limited` listens
with them. The RPC's limits (`RpcLimits`) are kept by its connections
(`ps_core.net.rpc`); `Occurrences` collapses their log lines.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

__all__ = ["Occurrences", "PortGuard", "PortLimits", "RpcLimits", "ServedPort", "listen", "serve_limited"]

log = logging.getLogger("ctrps.limits")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Occurrences:
    """A kind of event worth one log line, not one per occurrence: the first
    is logged, then at most one line every `every_s` seconds saying how many
    happened since (a flood of idle sockets gives a line a minute, not 20,000)."""

    def __init__(self, logger: logging.Logger, message: str, every_s: float = 60.0) -> None:
        self._log = logger
        self._message = message
        self._every_s = every_s
        self._last = -float("inf")
        self._held = 0
        self.total = 0
        """How many happened since start (a counter for the metrics)."""

    def happened(self, **fields: object) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._held += 1
            return
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        since = f" ({self._held + 1} since the last line)" if self._held else ""
        self._log.warning("%s%s%s total=%d", self._message, f" {extra}" if extra else "", since, self.total)
        self._last, self._held = now, 0


@dataclass(frozen=True)
class PortLimits:
    """Limits of one HTTP port."""

    max_connections: int = 1024
    """Concurrent connections; more are closed at once."""
    header_timeout_s: float = 10.0
    """Seconds from a connection opening until its first request head is in."""
    body_timeout_s: float = 30.0
    """Seconds from a request's head until its whole body is in (else 408)."""
    idle_timeout_s: float = 75.0
    """Seconds a kept-alive connection may wait for its next request."""
    max_line_size: int = 8190
    """Longest request line or header line, bytes (aiohttp's default)."""
    max_field_size: int = 8190
    """Longest header field, bytes (aiohttp's default)."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max connections must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds")

    def runner_kwargs(self) -> dict[str, Any]:
        """What `web.AppRunner` passes on to aiohttp's request handler."""
        return {
            "keepalive_timeout": self.idle_timeout_s,
            "max_line_size": self.max_line_size,
            "max_field_size": self.max_field_size,
        }


@dataclass(frozen=True)
class RpcLimits:
    """Limits of a shard's RPC port (`ps_core.net.rpc`)."""

    max_connections: int = 1024
    """Concurrent connections; more are closed at once."""
    hello_timeout_s: float = 5.0
    """Seconds a new connection has to send its hello."""
    frame_timeout_s: float = 30.0
    """Seconds from a frame's length prefix until its last byte."""
    buffer_budget_bytes: int = 1 << 30
    """Bytes of announced, unfinished frames all connections may hold at
    once; a frame that would take them over is refused (503 ``overloaded``)."""

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.buffer_budget_bytes < 1:
            raise ValueError("max connections and the buffer budget must be >= 1")
        for name in ("hello_timeout_s", "frame_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds")


class _GuardedConnection(asyncio.Protocol):
    """One connection of a guarded port: aiohttp's request handler inside,
    a deadline outside (`PortGuard` arms and disarms it)."""

    def __init__(self, guard: PortGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None
        """Loop time the connection is closed at, unless re-armed; None: no deadline."""
        self._loop = asyncio.get_running_loop()
        self._admitted = False
        # The inner handler's own method, not a forwarding one: a frame less
        # per packet (the transport reads it from the protocol once or per call).
        self.data_received = inner.data_received  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self._guard._admit(self):
            self.transport.abort()
            return
        self._admitted = True
        self._inner.connection_made(transport)
        self.arm(self._guard.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_timer()
        if self._admitted:
            self._guard._release(self)
            self._inner.connection_lost(exc)
        self.transport = None

    def data_received(self, data: bytes) -> None:  # replaced per instance by the inner one
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # Arming is per request on a keep-alive connection, so it only moves the
    # deadline: the one timer is kept, and when it fires before the deadline
    # (the connection was re-armed meanwhile) it is set again for the rest.
    # A timer per request cost 5 % of a single-event predict's CPU.
    def arm(self, seconds: float) -> None:
        loop = self._loop
        self._deadline = deadline = loop.time() + seconds
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)

    def disarm(self) -> None:
        self._deadline = None

    def _close_timer(self) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        deadline, transport = self._deadline, self.transport
        if deadline is None or transport is None:
            return
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._expire)
            return
        if transport.get_write_buffer_size() > 0:
            # A large response still going out: the peer is reading, not idle.
            self.arm(self._guard.limits.idle_timeout_s)
            return
        self._guard.head_timeouts.happened(port=self._guard.name)
        transport.abort()


class PortGuard:
    """One HTTP port's limits, its open connections and its counters.

    `install` adds its middlewares to an application (before its runner is
    set up); `serve_limited` then listens with it."""

    def __init__(self, name: str, limits: PortLimits) -> None:
        self.name = name
        self.limits = limits
        self._open: dict[object, _GuardedConnection] = {}
        self.refused = Occurrences(log, f"{name}: connection cap of {limits.max_connections} reached, closing new ones")
        self.head_timeouts = Occurrences(
            log,
            f"{name}: closed connections that sent no request head in time "
            f"({limits.header_timeout_s:g} s, {limits.idle_timeout_s:g} s kept alive)",
        )
        self.body_timeouts = Occurrences(
            log, f"{name}: answered 408 to requests whose body did not arrive within {limits.body_timeout_s:g} s"
        )

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, int]:
        """Counters for the metrics."""
        return {
            "open_connections": len(self._open),
            "refused_total": self.refused.total,
            "head_timeouts_total": self.head_timeouts.total,
            "body_timeouts_total": self.body_timeouts.total,
        }

    def _admit(self, conn: _GuardedConnection) -> bool:
        if len(self._open) >= self.limits.max_connections:
            self.refused.happened(port=self.name)
            return False
        self._open[conn.transport] = conn
        return True

    def _release(self, conn: _GuardedConnection) -> None:
        self._open.pop(conn.transport, None)

    def install(self, app: web.Application) -> None:
        """Add the guard's middlewares: outermost, the one that stops the head
        deadline once a request is in (and restarts it for keep-alive after the
        response); innermost, the one that reads the body under its deadline.
        (An app may instead call `begin`, `body_pending`, `read_body` and
        `end` from its handlers, as the API does.)"""
        app.middlewares.insert(0, self._request_middleware)
        app.middlewares.append(self._body_middleware)

    def begin(self, request: web.Request) -> _GuardedConnection | None:
        """A request is in: its connection's head deadline stops. Returns the
        connection to hand to `end`."""
        conn = self._open.get(request.transport)
        if conn is not None:
            conn.disarm()
        return conn

    def end(self, conn: _GuardedConnection | None) -> None:
        """The request `begin` returned `conn` for is answered: the keep-alive
        deadline starts."""
        if conn is not None and conn.transport is not None:
            conn.arm(self.limits.idle_timeout_s)

    @staticmethod
    def body_pending(request: web.Request) -> bool:
        """Whether part of `request`'s body is still to come (most small ones
        arrive in the head's packet and need no deadline)."""
        return request.body_exists and not request.content.is_eof()

    @web.middleware
    async def _request_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        conn = self.begin(request)
        try:
            return await handler(request)
        finally:
            self.end(conn)

    @web.middleware
    async def _body_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The rest are read under a deadline, without the task per request
        # `asyncio.wait_for` would start.
        if self.body_pending(request):
            handler = await self.read_body(request, handler)
        return await handler(request)

    async def read_body(self, request: web.Request, handler: Handler) -> Handler:
        """Read `request`'s body under the body deadline: `handler` when it
        came, else a handler answering 408 (counted)."""
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                await request.read()
        except TimeoutError:
            self.body_timeouts.happened(port=self.name, path=request.path)
            return self._body_timed_out
        return handler

    async def _body_timed_out(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPRequestTimeout(
            text='{"error": "body_timeout", "detail": "the request body did not arrive within '
            f'{self.limits.body_timeout_s:g} s"}}',
            content_type="application/json",
            headers={"Connection": "close"},
        )


@dataclass
class ServedPort:
    """A listening guarded port; `close` stops listening and cleans up the runner."""

    server: asyncio.AbstractServer
    runner: web.BaseRunner
    port: int
    """The port it listens on (the one the OS chose when asked for 0)."""

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()
        await self.server.wait_closed()


async def listen(
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    *,
    max_connections: int,
    handshake_timeout_s: float,
) -> asyncio.Server:
    """A server listening on `host`:`port` as both planes' ports listen: the
    address reused at once after a restart, a burst of connections queued
    (not refused) up to `max_connections` (the listen backlog, 4096 at
    most), and over TLS a handshake bounded by `handshake_timeout_s`."""
    return await asyncio.get_running_loop().create_server(
        protocol_factory,
        host,
        port,
        ssl=ssl_context,
        reuse_address=True,
        backlog=min(4096, max_connections),
        ssl_handshake_timeout=handshake_timeout_s if ssl_context is not None else None,
    )


async def serve_limited(
    runner: web.BaseRunner,
    guard: PortGuard,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> ServedPort:
    """Listen on `host`:`port` (0 picks a free port) with `runner`'s
    application (set up, its app given to `guard.install` before) under
    `guard`'s limits, over TLS when `ssl_context` is given."""
    handler_factory = runner.server
    if handler_factory is None:
        raise RuntimeError("the runner is not set up")
    # A TLS handshake is part of a request's head: it shares its deadline.
    server = await listen(
        lambda: _GuardedConnection(guard, cast(asyncio.Protocol, handler_factory())),
        host,
        port,
        ssl_context,
        max_connections=guard.limits.max_connections,
        handshake_timeout_s=guard.limits.header_timeout_s,
    )
    sockets = server.sockets or ()
    return ServedPort(server, runner, sockets[0].getsockname()[1] if sockets else port)
