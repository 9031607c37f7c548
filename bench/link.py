"""A worker's network link to the shards, for benchmarks: a bandwidth each
way, so that what a mode sends shows in its events/s as it would where the
network, not this machine's loopback, is the bottleneck.

A `Link` carries frames one after another in each direction: a frame of b
bytes holds its direction for ``b / rate`` seconds (serialisation delay, no
propagation delay). `linked_client` is a `PSClient` whose shard transports
(the TCP RPC, as ``ctrps worker`` uses) send and receive through one link:
a worker's link to all shards, as a pod's network interface would be.
A propagation delay (a far shard) is `tests/delay_proxy.py`'s: a TCP proxy
the tests use too (`bench_latency.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.transports import TcpTransport
from ps_core.net.wire import WireFormat

__all__ = ["Link", "linked_client"]


class Link:
    """`mbps` megabits a second each way, frames in turn."""

    def __init__(self, mbps: float) -> None:
        if not mbps > 0:
            raise ValueError("a link needs mbps > 0")
        self.bytes_per_s = mbps * 1e6 / 8
        self._free = {"up": 0.0, "down": 0.0}

    async def carry(self, direction: str, nbytes: int) -> None:
        """Wait until `nbytes` have crossed the link in `direction` (``up``:
        to the shards, ``down``: back), after the frames before them."""
        now = asyncio.get_running_loop().time()
        done = max(now, self._free[direction]) + nbytes / self.bytes_per_s
        self._free[direction] = done
        await asyncio.sleep(done - now)


class LinkedTransport(TcpTransport):
    """`TcpTransport` whose frames cross `link` both ways."""

    link: Link

    async def _frame_request(self, path: str, body: bytes) -> bytes:
        await self.link.carry("up", len(body))
        reply = await super()._frame_request(path, body)
        await self.link.carry("down", len(reply))
        return reply


def linked_client(urls: Sequence[str], wire: WireFormat, link: Link) -> PSClient:
    """A client of the shards at `urls` sending `wire` frames through `link`
    (as `PSClient.connect` would without one)."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=16, limit=0), skip_auto_headers=("User-Agent",)
    )
    transports = [LinkedTransport(i, u, session, RetryPolicy(), wire=wire) for i, u in enumerate(urls)]
    for t in transports:
        t.link = link
    return PSClient(transports, session=session)
