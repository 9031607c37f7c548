"""The shard's TCP RPC (`ps_core.net.rpc`) and the client's `TcpTransport`.

Real servers on loopback: a `Shard` behind its aiohttp app (which advertises
the RPC port in ``/healthz``) and its RPC server, both in the test's loop.
The client's results over the RPC equal the in-process shard's; what is
specific to the RPC is tested here: errors keep the connection usable, an
oversized request is refused, a stranger is turned away, pipelined calls get
their own replies, a restarted shard is found on its new port, a lost reply
is retried without applying the push twice, and an unreachable RPC ends in
`ShardUnavailableError` at the deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from consumers.broker import free_port
from ps_core.errors import FrameError, PSError, ShardUnavailableError, UnknownTableError
from ps_core.net import rpc as rpc_module
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.rpc import RpcConnection, RpcServer, RpcServerProtocol, start_rpc_server
from ps_core.net.server import create_shard_app
from ps_core.net.transports import TcpTransport
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

LR = TableConfig("lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})


class Served:
    """One shard behind its HTTP app and RPC server, restartable on a new RPC port."""

    def __init__(self, shard: Shard, max_body: int = 1 << 20) -> None:
        self.shard = shard
        self.max_body = max_body
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rpc: RpcServer | None = None
        self.runner: web.AppRunner | None = None

    async def start(self, rpc: bool = True) -> None:
        if rpc:
            self.rpc = await start_rpc_server(self.shard, "127.0.0.1", 0, max_body=self.max_body)
        app = create_shard_app(self.shard, rpc_port=self.rpc.port if self.rpc else None)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self.rpc is not None:
            await self.rpc.close()
            self.rpc = None
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    s = Served(Shard(ShardSpec(0, 1), (LR,)))
    await s.start()
    yield s
    await s.stop()


def keys_grads(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    return keys, rng.standard_normal((keys.size, 1)).astype(np.float32)


def transport(client: PSClient) -> TcpTransport:
    t = client.transports[0]
    assert isinstance(t, TcpTransport)
    return t


async def test_pull_push_push_pull_match_an_in_process_table(served: Served) -> None:
    ref = SparseTable(LR)
    keys, grads = keys_grads(500)
    nxt, _ = keys_grads(300, seed=1)
    async with PSClient.connect([served.url]) as client:
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
        assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
        ref.push(keys, grads, event_time=1e9)
        applied, got = await client.push_pull("lr", keys, grads, pull_keys=nxt, event_time=1e9)
        ref.push(keys, grads, event_time=1e9)
        assert applied == keys.size
        np.testing.assert_array_equal(got, ref.pull(nxt))
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
        t = transport(client)
        assert t.uses_rpc and t.rpc_port == served.rpc.port  # type: ignore[union-attr]


async def test_shard_errors_come_back_typed_and_the_connection_stays(served: Served) -> None:
    keys, grads = keys_grads(10)
    async with PSClient.connect([served.url]) as client:
        with pytest.raises(UnknownTableError, match="no table 'nope'"):
            await client.pull("nope", keys)
        conn = transport(client)._conn
        assert conn is not None and conn.is_open
        status, payload = await conn.call("/v1/pull", b"not a frame")
        assert status == 400 and b"bad_frame" in payload
        with pytest.raises(FrameError):
            await transport(client)._frame_request("/v1/pull", b"\x00" * 60)
        assert transport(client)._conn is conn and conn.is_open
        assert await client.push("lr", keys, grads) == keys.size


async def test_an_unexpected_failure_answers_500_and_later_calls_work(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, grads = keys_grads(10)
    original = rpc_module.handle_frame
    calls = {"n": 0}

    def flaky(shard: Shard, body: Any, expect_op: int | None = None) -> bytes:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(shard, body, expect_op)

    monkeypatch.setattr(rpc_module, "handle_frame", flaky)
    async with PSClient.connect([served.url]) as client:
        with pytest.raises(PSError, match="boom") as info:
            await client.pull("lr", keys)
        assert info.value.status == 500
        assert await client.push("lr", keys, grads) == keys.size


async def test_an_oversized_request_is_refused_and_the_client_reconnects() -> None:
    s = Served(Shard(ShardSpec(0, 1), (LR,)), max_body=4096)
    await s.start()
    try:
        async with PSClient.connect([s.url]) as client:
            big, _ = keys_grads(2000)  # 16 kB of keys
            with pytest.raises(PSError, match="too_large") as info:
                await client.pull("lr", big)
            assert info.value.status == 413
            small, grads = keys_grads(20)
            assert await client.push("lr", small, grads) == small.size
    finally:
        await s.stop()


async def test_a_client_that_does_not_greet_is_turned_away(served: Served) -> None:
    assert served.rpc is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", served.rpc.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, nothing said
    writer.close()
    await writer.wait_closed()


async def test_pipelined_calls_get_their_own_replies(served: Served) -> None:
    assert served.rpc is not None
    ref = SparseTable(LR)
    keys, grads = keys_grads(2000)
    ref.push(keys, grads, event_time=1e9)
    async with PSClient.connect([served.url]) as client:
        await client.push("lr", keys, grads, event_time=1e9)
        parts = np.array_split(keys, 40)
        got = await asyncio.gather(*(client.pull("lr", p) for p in parts))
        for p, g in zip(parts, got):
            np.testing.assert_array_equal(g, ref.pull(p))
        # One connection carried them all.
        assert len(served.rpc._connections) == 1


async def test_a_restarted_shard_is_found_on_its_new_rpc_port(served: Served) -> None:
    keys, grads = keys_grads(50)
    async with PSClient.connect([served.url], retry=RetryPolicy(deadline_s=5.0)) as client:
        assert await client.push("lr", keys, grads) == keys.size
        old_port = transport(client).rpc_port
        await served.stop()
        await served.start()  # the same shard state, a new RPC port
        assert served.rpc is not None and served.rpc.port != old_port
        assert await client.push("lr", keys, grads) == keys.size
        assert transport(client).rpc_port == served.rpc.port
    assert served.shard.table("lr").pushes == 2


async def test_a_push_whose_reply_is_lost_is_retried_and_applied_once(served: Served) -> None:
    """The shard applies the push, then the connection drops before the
    reply: the client retries the same frame (same request id) on a new
    connection and the shard acknowledges it without applying it again."""
    keys, grads = keys_grads(50)
    original = RpcServerProtocol._reply
    dropped = {"n": 0}

    def drop_first(self: RpcServerProtocol, status: int, payload: bytes) -> None:
        if dropped["n"] == 0:
            dropped["n"] += 1
            self._transport.abort()  # type: ignore[union-attr]
            return
        original(self, status, payload)

    ref = SparseTable(LR)
    ref.push(keys, grads, event_time=1e9)
    async with PSClient.connect([served.url], retry=RetryPolicy(deadline_s=5.0)) as client:
        await client.pull("lr", keys[:1])  # connected
        RpcServerProtocol._reply = drop_first  # type: ignore[method-assign]
        try:
            assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
        finally:
            RpcServerProtocol._reply = original  # type: ignore[method-assign]
        assert dropped["n"] == 1
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
    assert served.shard.table("lr").pushes == 1


async def test_an_rpc_port_that_stops_answering_ends_at_the_deadline(served: Served) -> None:
    """HTTP still up, the advertised RPC port closed: ShardUnavailableError
    naming the shard once the deadline has passed, not a hang."""
    keys, _ = keys_grads(10)
    async with PSClient.connect([served.url], retry=RetryPolicy(deadline_s=0.5)) as client:
        await client.pull("lr", keys)
        assert served.rpc is not None
        await served.rpc.close()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ShardUnavailableError, match=r"shard 0 at .* \(rpc\) unreachable"):
            await client.pull("lr", keys)
        assert loop.time() - t0 < 5.0


async def test_a_server_that_never_replies_times_out() -> None:
    """A server that greets and then stays silent: the call gives up at the
    deadline (and drops the connection, so no late reply is misread)."""

    class Silent(RpcServerProtocol):
        def _handle(self, body: bytes) -> None:
            return None

    shard = Shard(ShardSpec(0, 1), (LR,))
    loop = asyncio.get_running_loop()
    conns: set[RpcServerProtocol] = set()
    server = await loop.create_server(lambda: Silent(shard, 1 << 20, conns), "127.0.0.1", 0)
    rpc_port = server.sockets[0].getsockname()[1]
    app = create_shard_app(shard, rpc_port=rpc_port)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with PSClient.connect([f"http://127.0.0.1:{port}"], retry=RetryPolicy(deadline_s=0.4)) as client:
            with pytest.raises(
                ShardUnavailableError,
                match=r"\(rpc\) did not answer: no answer for [0-9.]+s \([0-9]+ attempts?, deadline 0\.4s",
            ):
                await client.pull("lr", keys_grads(10)[0])
    finally:
        server.close()
        await server.wait_closed()
        for c in list(conns):
            c.close()
        await runner.cleanup()


async def test_without_an_advertised_port_calls_go_over_http() -> None:
    s = Served(Shard(ShardSpec(0, 1), (LR,)))
    await s.start(rpc=False)
    try:
        keys, grads = keys_grads(30)
        async with PSClient.connect([s.url]) as client:
            assert await client.push("lr", keys, grads) == keys.size
            assert transport(client).uses_rpc is False
        async with PSClient.connect([s.url], rpc=False) as client:
            assert await client.pull("lr", keys) is not None
            assert not isinstance(client.transports[0], TcpTransport)
    finally:
        await s.stop()
    assert s.shard.table("lr").pulls == 1 and s.shard.table("lr").pushes == 1


async def test_a_connection_to_a_stranger_fails_to_open() -> None:
    """Something that is not a ctrps RPC server answers the greeting with
    other bytes: the open fails instead of misreading them."""

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(12)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionError, match="not a ctrps RPC server"):
            await asyncio.wait_for(RpcConnection.open("127.0.0.1", port), 5.0)
    finally:
        server.close()
        await server.wait_closed()


async def test_frames_larger_than_a_socket_read_cross_whole(served: Served) -> None:
    """A push and a pull of 300k keys (2.4 MB requests, arriving in many
    reads): the same weights as an in-process table."""
    served.max_body = 1 << 30
    await served.stop()
    await served.start()
    ref = SparseTable(LR)
    keys, grads = keys_grads(300_000, seed=3)
    ref.push(keys, grads, event_time=1e9)
    async with PSClient.connect([served.url]) as client:
        assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
        assert transport(client).uses_rpc
