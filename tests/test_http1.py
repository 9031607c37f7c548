"""The lean HTTP/1.1 client of the frame routes (`ps_core.http1`) and
`HttpTransport`'s use of it, against a shard's aiohttp app and against its
port's front (`ps_core.http1_server`).

Real servers on loopback: a `Shard` behind its aiohttp app, and small raw
servers where a reply must be one aiohttp would not send (chunked, read to
the close, interim, garbage, silence). The client suite (tests/test_client.py,
"http") checks results bit for bit against in-process tables; this file
tests the connection: pipelining, framings, ``Connection: close``, errors
that keep it, 502/503/504 retried, a lost reply retried without applying the
push twice, and failures ending at the deadline.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
from aiohttp import web

from consumers.broker import free_port
from ps_core import codec
from ps_core.client import HttpTransport, PSClient, RetryPolicy
from ps_core.errors import PSError, ShardUnavailableError, UnknownTableError
from ps_core.http1 import Http1Connection, _chunked_body
from ps_core.http1_server import start_shard_http
from ps_core.server import DEFAULT_MAX_BODY, create_shard_app
from ps_core.shard import Shard, ShardSpec
from ps_core.table import SparseTable, TableConfig
from waiting import until

LR = TableConfig("lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})


def keys_grads(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    return keys, rng.standard_normal((keys.size, 1)).astype(np.float32)


async def serve_app(app: web.Application, keepalive_timeout: float = 75.0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture(params=["app", "front"])
async def shard_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Shard, str]]:
    """A shard behind its aiohttp app alone, or on its port as ``ctrps
    shard`` serves it (frame requests answered by `ps_core.http1_server`)."""
    shard = Shard(ShardSpec(0, 1), (LR,))
    if request.param == "app":
        runner, url = await serve_app(create_shard_app(shard))
        yield shard, url
        await runner.cleanup()
        return
    runner = web.AppRunner(create_shard_app(shard), access_log=None)
    await runner.setup()
    front = await start_shard_http(runner, shard, "127.0.0.1", 0, max_body=DEFAULT_MAX_BODY)
    yield shard, f"http://127.0.0.1:{front.port}"
    await front.cleanup()


def transport(client: PSClient) -> HttpTransport:
    t = client.transports[0]
    assert type(t) is HttpTransport
    return t


async def raw_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, int]:
    """A TCP server on a free port running `handle` per connection (the
    connection is closed when it returns)."""

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(run, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's body (Content-Length framed), as the client sends it."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


# -- against the shard's aiohttp app -----------------------------------------


async def test_pipelined_calls_on_one_connection_get_their_own_replies(
    shard_url: tuple[Shard, str],
) -> None:
    shard, url = shard_url
    ref = SparseTable(LR)
    keys, grads = keys_grads(3000)
    ref.push(keys, grads, event_time=1e9)
    port = int(url.rsplit(":", 1)[1])
    conn = await Http1Connection.open("127.0.0.1", port)
    try:
        status, _ = await conn.call("/v1/push", codec.encode_push("lr", keys, grads, event_time=1e9, request_id=1))
        assert status == 200
        parts = np.array_split(keys, 40)
        # All 40 requests are written before any reply is read.
        futs = [conn.call("/v1/pull", codec.encode_pull("lr", p)) for p in parts]
        for p, (status, reply) in zip(parts, await asyncio.gather(*futs)):
            assert status == 200
            np.testing.assert_array_equal(codec.decode(reply, codec.Op.WEIGHTS).values, ref.pull(p))
        assert conn.is_open
    finally:
        await conn.close()
    assert shard.table("lr").pulls == 40


async def test_results_match_an_in_process_table_over_the_lean_connection(
    shard_url: tuple[Shard, str],
) -> None:
    shard, url = shard_url
    ref = SparseTable(LR)
    keys, grads = keys_grads(500)
    nxt, _ = keys_grads(300, seed=1)
    async with PSClient.connect([url], rpc=False) as client:
        assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
        ref.push(keys, grads, event_time=1e9)
        applied, got = await client.push_pull("lr", keys, grads, pull_keys=nxt, event_time=1e9)
        ref.push(keys, grads, event_time=1e9)
        assert applied == keys.size
        np.testing.assert_array_equal(got, ref.pull(nxt))
        assert isinstance(transport(client)._conn, Http1Connection)
    assert shard.table("lr").pushes == 2


async def test_shard_errors_come_back_typed_and_the_connection_stays(
    shard_url: tuple[Shard, str],
) -> None:
    _, url = shard_url
    keys, grads = keys_grads(10)
    async with PSClient.connect([url], rpc=False) as client:
        await client.pull("lr", keys)
        conn = transport(client)._conn
        with pytest.raises(UnknownTableError, match="no table 'nope'"):
            await client.pull("nope", keys)
        assert conn is not None and conn.is_open
        status, payload = await conn.call("/v1/pull", b"not a frame")
        assert status == 400 and b"bad_frame" in payload
        assert await client.push("lr", keys, grads) == keys.size
        assert transport(client)._conn is conn


async def test_an_oversized_request_gets_413_and_later_calls_work() -> None:
    shard = Shard(ShardSpec(0, 1), (LR,))
    runner, url = await serve_app(create_shard_app(shard, max_body=4096))
    try:
        async with PSClient.connect([url], rpc=False) as client:
            big, _ = keys_grads(2000)  # 16 kB of keys
            with pytest.raises(PSError, match="too_large") as info:
                await client.pull("lr", big)
            assert info.value.status == 413
            small, grads = keys_grads(20)
            assert await client.push("lr", small, grads) == small.size
    finally:
        await runner.cleanup()


async def test_a_connection_the_server_closes_when_idle_is_reopened() -> None:
    shard = Shard(ShardSpec(0, 1), (LR,))
    runner, url = await serve_app(create_shard_app(shard), keepalive_timeout=0.05)
    try:
        async with PSClient.connect([url], rpc=False) as client:
            keys, grads = keys_grads(20)
            assert await client.push("lr", keys, grads) == keys.size
            first = transport(client)._conn
            assert first is not None
            await until(lambda: not first.is_open, 5, what="the server to close the idle connection")
            assert await client.push("lr", keys, grads) == keys.size
            assert transport(client)._conn is not first
    finally:
        await runner.cleanup()
    assert shard.table("lr").pushes == 2


async def test_a_reply_saying_connection_close_ends_the_connection() -> None:
    shard = Shard(ShardSpec(0, 1), (LR,))

    async def closing(request: web.Request) -> web.Response:
        resp = web.Response(body=shard.handle_frame(await request.read()))
        resp.force_close()
        return resp

    app = web.Application()
    app.router.add_post("/v1/push", closing)
    runner, url = await serve_app(app)
    try:
        async with PSClient.connect([url], rpc=False) as client:
            keys, grads = keys_grads(20)
            conns = []
            for _ in range(3):
                assert await client.push("lr", keys, grads) == keys.size
                conns.append(transport(client)._conn)
            assert len({id(c) for c in conns}) == 3
            assert not any(c.is_open for c in conns if c is not None)
    finally:
        await runner.cleanup()


async def test_502_503_504_are_retried_until_the_shard_answers() -> None:
    shard = Shard(ShardSpec(0, 1), (LR,))
    answers = [502, 503, 504]

    async def flaky(request: web.Request) -> web.Response:
        body = await request.read()
        if answers:
            return web.Response(status=answers.pop(0), text="the balancer has no backend")
        return web.Response(body=shard.handle_frame(body))

    app = web.Application()
    app.router.add_post("/v1/push", flaky)
    runner, url = await serve_app(app)
    try:
        async with PSClient.connect([url], rpc=False, retry=RetryPolicy(deadline_s=5.0, first_delay_s=0.001)) as client:
            keys, grads = keys_grads(20)
            assert await client.push("lr", keys, grads) == keys.size
        assert answers == []
    finally:
        await runner.cleanup()
    assert shard.table("lr").pushes == 1


async def test_a_push_whose_reply_is_lost_is_retried_and_applied_once(
    shard_url: tuple[Shard, str],
) -> None:
    """A proxy passes the request to the shard, which applies it, then cuts
    the client off instead of passing the reply: the client retries the same
    frame (same request id) on a new connection and the shard acknowledges
    it without applying it again."""
    shard, url = shard_url
    upstream_port = int(url.rsplit(":", 1)[1])
    cut = {"armed": False, "done": 0}

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool) -> None:
            while data := await src.read(65536):
                if replies and cut["armed"]:
                    cut["armed"] = False
                    cut["done"] += 1
                    writer.transport.abort()
                    return
                dst.write(data)
                await dst.drain()

        try:
            await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True))
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
            up_writer.transport.abort()

    server, port = await raw_server(proxy)
    ref = SparseTable(LR)
    keys, grads = keys_grads(50)
    ref.push(keys, grads, event_time=1e9)
    try:
        async with PSClient.connect([f"http://127.0.0.1:{port}"], rpc=False, retry=RetryPolicy(deadline_s=5.0)) as client:
            await client.pull("lr", keys[:1])  # connected
            cut["armed"] = True
            assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
            assert cut["done"] == 1
            np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
    finally:
        server.close()
        await server.wait_closed()
    assert shard.table("lr").pushes == 1


# -- replies aiohttp would not send --------------------------------------------


async def test_chunked_interim_and_close_delimited_replies_are_read() -> None:
    replies = [
        # chunked, with an extension and a trailer
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;x=y\r\nabc\r\n4\r\ndefg\r\n0\r\nX-Trailer: 1\r\n\r\n",
        # an interim reply first
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        # no length: the body runs to the close
        b"HTTP/1.0 200 OK\r\nContent-Type: x\r\n\r\nto the end",
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in replies:
            await read_request(reader)
            writer.write(reply)
            await writer.drain()

    server, port = await raw_server(handle)
    try:
        conn = await Http1Connection.open("127.0.0.1", port)
        futs = [conn.call("/x", b"body") for _ in replies]
        got = await asyncio.wait_for(asyncio.gather(*futs), 5.0)
        assert got == [(200, b"abcdefg"), (201, b"ok"), (200, b"to the end")]
        assert not conn.is_open
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "reply, why",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x reply"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "not an HTTP/1.x reply"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunked body"),
    ],
)
async def test_a_reply_that_is_not_http_fails_the_call(reply: bytes, why: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        await reader.read()  # until the client drops the connection

    server, port = await raw_server(handle)
    try:
        conn = await Http1Connection.open("127.0.0.1", port)
        with pytest.raises(ConnectionError, match=why):
            await asyncio.wait_for(conn.call("/v1/pull", b"x"), 5.0)
        assert not conn.is_open
    finally:
        server.close()
        await server.wait_closed()


async def test_a_server_that_never_replies_ends_at_the_deadline() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server, port = await raw_server(silent)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with PSClient.connect([f"http://127.0.0.1:{port}"], rpc=False, retry=RetryPolicy(deadline_s=0.4)) as client:
            with pytest.raises(ShardUnavailableError, match="shard 0 at .* unreachable.*TimeoutError"):
                await client.pull("lr", keys_grads(10)[0])
        assert loop.time() - t0 < 5.0
    finally:
        server.close()
        await server.wait_closed()


async def test_a_closed_port_ends_at_the_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with PSClient.connect([url], rpc=False, retry=RetryPolicy(deadline_s=0.3)) as client:
        with pytest.raises(ShardUnavailableError, match="unreachable after [0-9]+ attempts"):
            await client.push("lr", *keys_grads(5))


def test_chunked_bodies_are_parsed_incrementally() -> None:
    whole = b"5\r\nhello\r\n1\r\n \r\n0\r\n\r\nNEXT"
    for cut in range(len(whole) - 4):
        assert _chunked_body(bytearray(whole[:cut]), 0) is None
    assert _chunked_body(bytearray(whole), 0) == (b"hello ", len(whole) - 4)
    with pytest.raises(ValueError):
        _chunked_body(bytearray(b"5\r\nhelloXX0\r\n\r\n"), 0)
