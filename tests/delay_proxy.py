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
import contextlib
from collections.abc import Sequence
from types import TracebackType

from ps_core.net.client import PSClient
from ps_core.net.transports import TcpTransport

__all__ = ["DelayProxy", "through"]

_CHUNK = 1 << 16


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
        self._pumps: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port it listens on (once started)."""
        assert self._server is not None, "the proxy is not started"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for t in list(self._pumps):
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pumps.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.close()
            self._pumps.discard(task)
            return
        try:
            await asyncio.gather(self._carry(reader, up_writer, "up"), self._carry(up_reader, writer, "down"))
        except (OSError, asyncio.IncompleteReadError):
            pass  # either end went away: so does the other
        finally:
            for w in (writer, up_writer):
                w.close()
            self._pumps.discard(task)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str) -> None:
        """Read chunks as they come; deliver each `delay_s` after it was read."""
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await line.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:  # the sender closed its side
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
                self._in_flight -= 1

        delivering = asyncio.create_task(deliver())
        try:
            while chunk := await reader.read(_CHUNK):
                if way == "up" and self._in_flight == 0:
                    self.rounds += 1
                self._in_flight += 1
                self.chunks[way] += 1
                line.put_nowait((loop.time() + self.delay_s, chunk))
            line.put_nowait((loop.time() + self.delay_s, b""))
            await delivering
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await delivering


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
