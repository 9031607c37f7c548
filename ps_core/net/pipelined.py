"""A persistent connection on which calls are pipelined and replies matched
to them in order, at both ends: the TCP RPC's (`ps_core.net.rpc`).

`PipelinedProtocol` and `PipelinedConnection` are the client's side (a
subclass says how a reply is read), `ServerConnection` the server's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import cast

__all__ = ["PipelinedConnection", "PipelinedProtocol", "Reply", "ServerConnection"]

Reply = tuple[int, bytes]
"""A call's outcome: the status (HTTP's meaning) and the reply body."""


class PipelinedProtocol(asyncio.Protocol):
    """The client side of one connection: the calls waiting, oldest first.
    Subclasses parse `data_received` and hand each reply to `deliver`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Reply]] = deque()
        self.lost: Exception | None = None
        """Why the connection ended, once it has."""
        self.closing = False
        """The server announced it ends the connection: no new calls on it."""
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, but are ones.)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:  # (`fail` has said why it aborted)
            self.lost = exc if exc is not None else ConnectionResetError("connection closed by the server")
        self.transport = None
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(ConnectionResetError(str(self.lost)))

    def deliver(self, status: int, payload: bytes) -> bool:
        """Give the oldest waiting call its reply; False (and the connection
        dropped) when no call waits: the stream is out of step."""
        if not self.waiting:
            self.fail("a reply nobody asked for")
            return False
        fut = self.waiting.popleft()
        if not fut.done():  # a cancelled call's reply is read and dropped
            fut.set_result((status, payload))
        return True

    def fail(self, why: str) -> None:
        """Drop the connection: the stream cannot be read (waiting calls get `why`)."""
        if self.lost is None:
            self.lost = ConnectionError(why)
        self._buf.clear()
        if self.transport is not None:
            self.transport.abort()


class PipelinedConnection:
    """A client's connection to one server; calls may overlap."""

    def __init__(self, protocol: PipelinedProtocol) -> None:
        self._protocol = protocol
        # Kept: `asyncio.get_running_loop()` is a getpid() system call per call.
        self._loop = asyncio.get_running_loop()

    @property
    def is_open(self) -> bool:
        """Whether new calls may use it (connected, and the server did not
        announce its close)."""
        return self._protocol.transport is not None and not self._protocol.closing

    def _send(self, parts: Iterable[bytes], timeout_s: float | None = None) -> asyncio.Future[Reply]:
        """Write one request; the future gets its reply, a ConnectionError,
        or a TimeoutError after `timeout_s` (then drop the connection: its
        reply may still come, and the next call must not read it as its own)."""
        protocol = self._protocol
        fut: asyncio.Future[Reply] = self._loop.create_future()
        if protocol.transport is None or protocol.closing:
            fut.set_exception(ConnectionResetError(f"connection closed: {protocol.lost}"))
            return fut
        protocol.waiting.append(fut)
        protocol.transport.writelines(parts)
        if timeout_s is not None:
            # A timer on the call's own future, rather than asyncio.wait_for's
            # second future and callbacks around it: this is every pull's path.
            timer = self._loop.call_later(timeout_s, _time_out, fut, timeout_s)
            fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def abort(self) -> None:
        """Drop the connection at once; calls waiting get a ConnectionError."""
        if self._protocol.transport is not None:
            self._protocol.transport.abort()

    async def close(self) -> None:
        """Close the connection (requests written are sent first)."""
        transport = self._protocol.transport
        if transport is not None:
            transport.close()


def _time_out(fut: asyncio.Future[Reply], timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no reply within {timeout_s:g} s"))


# Pause reading a connection whose replies pile up unsent (a client that
# pipelines without reading); resume once the buffer drains.
_WRITE_HIGH = 8 << 20
_WRITE_LOW = 1 << 20


class ServerConnection(asyncio.Protocol):
    """A server's side of one pipelined connection, kept in `connections`
    while open (so that a server closing can close it)."""

    def __init__(self, connections: set[ServerConnection]) -> None:
        self._connections = connections
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, but are ones.)
        self._transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def close(self) -> None:
        """Close the connection (replies written are sent first)."""
        if self._transport is not None:
            self._transport.close()
