"""The shard's HTTP port (`ps_core.http1_server`): frame requests answered by
the front, everything else by the aiohttp app, on the same connections.

Each test runs a shard behind `start_shard_http` on loopback; where the
answer must be aiohttp's, a second shard of the same tables behind the
plain aiohttp app is asked the same and the two answers compared.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from consumers.broker import free_port
from ps_core import codec
from ps_core.client import PSClient
from ps_core.http1 import Http1Connection
from ps_core.http1_server import FrameFront, ShardHttpServer, start_shard_http
from ps_core.server import FRAME_CONTENT_TYPE, create_shard_app
from ps_core.shard import Shard, ShardSpec
from ps_core.table import SparseTable, TableConfig
from waiting import until

LR = TableConfig("lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})


def keys_grads(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    return keys, rng.standard_normal((keys.size, 1)).astype(np.float32)


class Front:
    """A shard on its HTTP port as ``ctrps shard`` serves it; `handled`
    counts the requests the front answered itself."""

    def __init__(self, shard: Shard, server: ShardHttpServer, handled: list[int]) -> None:
        self.shard = shard
        self.server = server
        self.handled = handled
        self.port = server.port
        self.url = f"http://127.0.0.1:{server.port}"


async def start_front(max_body: int = 1 << 20, keepalive_s: float = 75.0) -> Front:
    shard = Shard(ShardSpec(0, 1), (LR,))
    runner = web.AppRunner(create_shard_app(shard, max_body=max_body), access_log=None)
    await runner.setup()
    server = await start_shard_http(runner, shard, "127.0.0.1", 0, max_body=max_body, keepalive_s=keepalive_s)
    return Front(shard, server, [])


@pytest.fixture
async def front(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Front]:
    f = await start_front()
    handle = FrameFront._handle

    def counting(self: FrameFront, body: bytes, op: int, keep_alive: bool) -> None:
        f.handled.append(op)
        handle(self, body, op, keep_alive)

    monkeypatch.setattr(FrameFront, "_handle", counting)
    yield f
    await f.server.cleanup()


@pytest.fixture
async def plain() -> AsyncIterator[str]:
    """The same tables behind the aiohttp app alone."""
    shard = Shard(ShardSpec(0, 1), (LR,))
    runner = web.AppRunner(create_shard_app(shard, max_body=1 << 20), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"127.0.0.1:{port}"
    await runner.cleanup()


Reply = tuple[int, dict[str, str], bytes]


async def exchange(port: int, data: bytes, replies: int) -> tuple[list[Reply], bool]:
    """Send raw bytes on a new connection; read `replies` replies (framed by
    Content-Length) and whether the server then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[Reply] = []
    try:
        writer.write(data)
        async with asyncio.timeout(10):
            for _ in range(replies):
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ")[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers["content-length"]))
                out.append((status, headers, body))
            try:
                closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
            except TimeoutError:
                closed = False
    finally:
        writer.close()
    return out, closed


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + FRAME_CONTENT_TYPE.encode()
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


# -- what the front answers ------------------------------------------------------


async def test_frame_calls_are_answered_by_the_front_and_match_a_table(front: Front) -> None:
    ref = SparseTable(LR)
    keys, grads = keys_grads(500)
    nxt, _ = keys_grads(300, seed=1)
    async with PSClient.connect([front.url], rpc=False) as client:
        assert await client.push("lr", keys, grads, event_time=1e9) == keys.size
        ref.push(keys, grads, event_time=1e9)
        applied, got = await client.push_pull("lr", keys, grads, pull_keys=nxt, event_time=1e9)
        ref.push(keys, grads, event_time=1e9)
        assert applied == keys.size
        np.testing.assert_array_equal(got, ref.pull(nxt))
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
        # The other calls go to the app on the same port.
        assert (await client.stats())[0]["tables"]["lr"]["pushes"] == 2
    assert front.handled == [codec.Op.PUSH, codec.Op.PUSH_PULL, codec.Op.PULL]


async def test_a_body_arriving_in_pieces_is_read_whole(front: Front) -> None:
    keys, grads = keys_grads(2000)
    request = post("/v1/push", codec.encode_push("lr", keys, grads, request_id=3))
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        for i in range(0, len(request), 997):
            writer.write(request[i : i + 997])
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Date: " in head
    finally:
        writer.close()
    assert front.shard.table("lr").pushes == 1


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/pull", codec.encode_pull("nope", np.arange(3, dtype=np.uint64))),  # 404 unknown_table
        ("/v1/pull", b"not a frame"),  # 400 bad_frame
        ("/v1/pull", codec.encode_push("lr", np.arange(3, dtype=np.uint64), np.ones((3, 1), np.float32))),  # op
        ("/v1/push", codec.encode_push("lr", np.arange(3, dtype=np.uint64), np.full((3, 1), np.nan, np.float32))),
    ],
    ids=["unknown_table", "bad_frame", "wrong_op", "invalid_values"],
)
async def test_errors_are_the_apps_errors(front: Front, plain: str, path: str, body: bytes) -> None:
    got, closed = await exchange(front.port, post(path, body), 1)
    want, _ = await exchange(int(plain.rsplit(":", 1)[1]), post(path, body), 1)
    (status, headers, reply), = got
    assert 400 <= status < 500 and not closed
    assert (status, reply) == (want[0][0], want[0][2])
    assert headers["content-type"] == want[0][1]["content-type"]
    assert front.handled  # the front answered it, not the app


async def test_an_unexpected_failure_answers_500_and_the_connection_stays(
    front: Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(body: bytes, expect_op: int | None = None) -> bytes:
        raise RuntimeError("a bug")

    monkeypatch.setattr(front.shard, "handle_frame", broken)
    keys, _ = keys_grads(5)
    request = post("/v1/pull", codec.encode_pull("lr", keys))
    got, closed = await exchange(front.port, request + request, 2)
    assert [(s, orjson_error(b)) for s, _, b in got] == [(500, "internal"), (500, "internal")]
    assert not closed


def orjson_error(body: bytes) -> str:
    import orjson

    return str(orjson.loads(body)["error"])


async def test_an_oversized_body_gets_413_and_the_connection_closes() -> None:
    f = await start_front(max_body=4096)
    try:
        big, _ = keys_grads(2000)  # 16 kB of keys
        got, closed = await exchange(f.port, post("/v1/pull", codec.encode_pull("lr", big)), 1)
        assert got[0][0] == 413 and orjson_error(got[0][2]) == "too_large" and closed
        async with PSClient.connect([f.url], rpc=False) as client:
            small, grads = keys_grads(20)
            assert await client.push("lr", small, grads) == small.size
    finally:
        await f.server.cleanup()


async def test_connection_close_is_honoured(front: Front) -> None:
    keys, _ = keys_grads(5)
    got, closed = await exchange(front.port, post("/v1/pull", codec.encode_pull("lr", keys), b"Connection: close\r\n"), 1)
    assert got[0][0] == 200 and got[0][1]["connection"] == "close" and closed


# -- what the front hands to aiohttp ------------------------------------------------


async def test_other_requests_on_a_connection_go_to_the_app_from_then_on(front: Front) -> None:
    """Frame request (front), GET (the connection passes to the app), frame
    request (the app): one connection, every answer right."""
    ref = SparseTable(LR)
    keys, grads = keys_grads(100)
    ref.push(keys, grads, event_time=1e9)
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as http:
        headers = {"Content-Type": FRAME_CONTENT_TYPE}
        push = codec.encode_push("lr", keys, grads, event_time=1e9, request_id=9)
        async with http.post(front.url + "/v1/push", data=push, headers=headers) as resp:
            assert resp.status == 200
            assert codec.decode(await resp.read(), codec.Op.ACK).count == keys.size
        async with http.get(front.url + "/healthz") as resp:
            assert (await resp.json())["shard_id"] == 0
        async with http.post(front.url + "/v1/pull", data=codec.encode_pull("lr", keys), headers=headers) as resp:
            reply = await resp.read()
        np.testing.assert_array_equal(codec.decode(reply, codec.Op.WEIGHTS).values, ref.pull(keys))
    assert front.handled == [codec.Op.PUSH]  # the pull was the app's
    assert front.shard.table("lr").pulls == 1


@pytest.mark.parametrize(
    "request_bytes",
    [
        # chunked request body
        b"POST /v1/pull HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        # HTTP/1.0
        b"POST /v1/pull HTTP/1.0\r\nHost: x\r\nContent-Length: %d\r\n\r\n",
        # Expect: 100-continue
        b"POST /v1/pull HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n",
    ],
    ids=["chunked", "http_1_0", "expect_continue"],
)
async def test_requests_the_front_does_not_serve_are_the_apps(front: Front, request_bytes: bytes) -> None:
    keys, _ = keys_grads(5)
    body = codec.encode_pull("lr", keys)
    if b"chunked" in request_bytes:
        data = request_bytes + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        data = request_bytes % len(body) + body
    replies = 2 if b"Expect" in request_bytes else 1  # 100 Continue, then the reply
    got, _ = await exchange(front.port, data, replies) if replies == 1 else await exchange_after_continue(front.port, data)
    status, _, reply = got[-1]
    assert status == 200
    np.testing.assert_array_equal(codec.decode(reply, codec.Op.WEIGHTS).values, np.zeros((keys.size, 1), np.float32))
    assert front.handled == []


async def exchange_after_continue(port: int, data: bytes) -> tuple[list[Reply], bool]:
    """The reply after an interim ``100 Continue`` (which has no body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(10):
            interim = await reader.readuntil(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100")
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers["content-length"]))
    finally:
        writer.close()
    return [(int(lines[0].split(" ")[1]), headers, body)], False


async def test_a_malformed_head_is_the_apps_to_refuse(front: Front) -> None:
    got, closed = await exchange(front.port, b"POST /v1/pull HTTP/1.1\r\nContent-Length : 3\r\n\r\nabc", 1)
    assert got[0][0] == 400 and front.handled == []


# -- connections ---------------------------------------------------------------------


async def test_an_idle_connection_is_closed() -> None:
    f = await start_front(keepalive_s=0.1)
    try:
        conn = await Http1Connection.open("127.0.0.1", f.port)
        status, _ = await conn.call("/v1/pull", codec.encode_pull("lr", keys_grads(3)[0]))
        assert status == 200
        await until(lambda: not conn.is_open, 5, what="the idle connection to be closed")
    finally:
        await f.server.cleanup()


async def test_cleanup_closes_every_connection(front: Front) -> None:
    lean = await Http1Connection.open("127.0.0.1", front.port)
    assert (await lean.call("/v1/pull", codec.encode_pull("lr", keys_grads(3)[0])))[0] == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # handed to the app
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await front.server.cleanup()
    try:
        await until(lambda: not lean.is_open, 5, what="the front's connection to close")
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass  # the rest of the health reply, then the close
    finally:
        writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", front.port)
