"""A TCP proxy that delays each direction by a fixed time: a far shard on
loopback, for tests and benchmarks (this machine has no netem).

`DelayProxy` listens on 127.0.0.1 (port 0) and forwards every connection to
its target, each chunk read delivered `delay_s` later, in order, while later
chunks travel behind it (a link's propagation delay, not a bandwidth:
`bench/link.py` has that). It counts `rounds`: requests that set out on an
idle link (nothing in flight either way, on any of its connections), so a
client that waits for each reply before its next request makes one round per
request, and one that keeps several requests in flight makes fewer.
`through` points a client's shard RPC at the proxies.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from types import TracebackType
from typing import cast

from ps_core.net.client import PSClient
from ps_core.net.transports import TcpTransport

__all__ = ["DelayProxy", "through"]


class _Side(asyncio.Protocol):
    """One end of a proxied connection: what it receives reaches `peer`
    `delay_s` later, by a timer (no task per chunk: the proxy's own cost
    stays small beside what it delays)."""

    def __init__(self, proxy: DelayProxy, way: str) -> None:
        self.proxy, self.way = proxy, way
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []
        """What arrived before the peer connected (sent on connecting)."""
        self.line: collections.deque[tuple[float, bytes]] = collections.deque()
        """What this side is to send, each chunk with the time it is due."""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self.proxy._carry(self, data)

    def eof_received(self) -> bool | None:
        self.proxy._carry(self, b"")
        return True  # half-closed until the delayed EOF reaches the other end

    def connection_lost(self, exc: Exception | None) -> None:
        self.proxy._sides.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def send_later(self, chunk: bytes, due: float) -> None:
        """`chunk` (b"": the far end's EOF) out of this side at `due`, after
        every chunk before it (one timer per side keeps them in order)."""
        self.line.append((due, chunk))
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_at(due, self._deliver)

    def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer = None
        t = self.transport
        while self.line and self.line[0][0] <= loop.time():
            _, chunk = self.line.popleft()
            self.proxy._in_flight -= 1
            if t is None or t.is_closing():
                continue
            if chunk:
                t.write(chunk)
            elif t.can_write_eof():
                t.write_eof()
        if self.line:
            self.timer = loop.call_at(self.line[0][0], self._deliver)


class DelayProxy:
    """Forwards 127.0.0.1:`port` to `host`:`target_port`, `delay_s` each way.
    ``async with DelayProxy(...) as proxy`` (or `start` and `close`)."""

    def __init__(self, host: str, target_port: int, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError("a delay must be >= 0 seconds")
        self.host, self.target_port, self.delay_s = host, target_port, delay_s
        self.rounds = 0
        """Chunks sent towards the target while nothing was in flight."""
        self.chunks = {"up": 0, "down": 0}
        """Chunks carried each way (up: towards the target)."""
        self._in_flight = 0
        self._server: asyncio.Server | None = None
        self._sides: set[_Side] = set()
        self._connecting: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port it listens on (once started)."""
        assert self._server is not None, "the proxy is not started"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> DelayProxy:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accepted, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connecting):
            task.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        for side in list(self._sides):
            if side.transport is not None:
                side.transport.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    def _accepted(self) -> _Side:
        client = _Side(self, "up")
        self._sides.add(client)
        task = asyncio.get_running_loop().create_task(self._connect(client))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)
        return client

    async def _connect(self, client: _Side) -> None:
        """Open the target's side of `client`'s connection."""
        loop = asyncio.get_running_loop()
        try:
            _, target = await loop.create_connection(lambda: _Side(self, "down"), self.host, self.target_port)
        except OSError:
            if client.transport is not None:
                client.transport.close()
            return
        self._sides.add(target)
        client.peer, target.peer = target, client
        due = loop.time() + self.delay_s
        for chunk in client.early:  # already counted in flight
            self.chunks["up"] += bool(chunk)
            target.send_later(chunk, due)
        client.early.clear()

    def _carry(self, side: _Side, chunk: bytes) -> None:
        """`chunk` received by `side`, delivered out of its peer `delay_s` later."""
        if side.way == "up" and chunk and self._in_flight == 0:
            self.rounds += 1
        self._in_flight += 1
        if side.peer is None:  # the target not connected yet
            side.early.append(chunk)
            return
        self.chunks[side.way] += bool(chunk)
        side.peer.send_later(chunk, asyncio.get_running_loop().time() + self.delay_s)


def through(client: PSClient, proxies: Sequence[DelayProxy]) -> PSClient:
    """`client` (of `PSClient.connect`, over the shards' RPC) with shard i's
    RPC reached through ``proxies[i]``: its port given instead of the one the
    shard's ``/healthz`` advertises. A connection that fails reads
    ``/healthz`` again, and goes direct: a benchmark's or test's link, not a
    product feature."""
    if len(proxies) != len(client.transports):
        raise ValueError(f"{len(proxies)} proxies for {len(client.transports)} shards")
    for t, proxy in zip(client.transports, proxies):
        if not isinstance(t, TcpTransport):
            raise TypeError(f"shard {t.shard_id}'s transport is not the RPC's: {type(t).__name__}")
        t.rpc_port = proxy.port
    return client
