"""Limits on every port (`ps_core.net.limits`, `ps_core.net.rpc`): what idle, slow and
greedy peers did to the API and the shards, reproduced on real servers on
loopback with small limits, and what each port now does about it.

- connections that never send a request head (half-open requests) are closed
  after the head deadline, while real requests are served;
- connections over the cap are closed at once, logged once, counted;
- a chunked body announcing ``ffffffff`` and never coming gets 408, and a body
  over the limit arriving after its head a JSON 413;
- a kept-alive connection left idle is closed;
- RPC connections that never greet are closed after the hello deadline;
- frames announced at 512 MiB and trickled hold no more than the process's
  buffer budget, are refused past it, and are cut off at the frame deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from waiting import until

from app.api import ApiServer
from app.config.declared import SettingsError
from app.config.limits import port_limits_from_env, rpc_limits_from_env
from app.config.serve import ApiSettings
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net import codec, op_encoders
from ps_core.net.client import PSClient
from ps_core.net.limits import PortGuard, PortLimits, RpcLimits, serve_limited
from ps_core.net.rpc import MAGIC, PROTOCOL_VERSION, RpcConnection, RpcServer, start_rpc_server
from ps_core.net.server import create_shard_app
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

LR = TableConfig("ctr_lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})
SMALL = PortLimits(max_connections=20, header_timeout_s=0.3, body_timeout_s=0.3, idle_timeout_s=0.5)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after `seconds`."""
    got = b""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


@asynccontextmanager
async def _api(limits: PortLimits) -> AsyncIterator[ApiServer]:
    shards = [Shard(ShardSpec(0, 1), [LR])]
    client, control = PSClient.local(shards), ControlClient.local(shards)
    server = ApiServer(ApiSettings(port=0, limits=limits), client, make_model("lr"), control=control)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        await client.close()


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with _api(SMALL) as server:
        yield server


@pytest.fixture
async def patient_api() -> AsyncIterator[ApiServer]:
    """The API under `SMALL`'s limits but a body deadline a busy machine
    meets: a megabyte over loopback can take longer than 0.3 s there."""
    async with _api(dataclasses.replace(SMALL, body_timeout_s=30.0)) as server:
        yield server


def _port(server: ApiServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


async def test_half_open_requests_are_closed_and_real_ones_served(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    port = _port(api)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
    # One that sends half a head and stops (slowloris).
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    idle.append((r, w))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api.url}/healthz") as resp:  # served meanwhile
            assert resp.status == 200
    with caplog.at_level(logging.WARNING, logger="ctrps.limits"):
        results = await asyncio.gather(*(_closed_within(r, 3.0) for r, _ in idle))
    assert all(got is not None for got in results), "a connection that sent no head stayed open"
    assert api.guard.stats()["head_timeouts_total"] == 11
    lines = [r for r in caplog.records if "no request head in time" in r.getMessage()]
    assert len(lines) == 1 and "total=1" in lines[0].getMessage()
    for _, w in idle:
        w.close()


async def test_connections_over_the_cap_are_closed_logged_once_and_counted(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    port = _port(api)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(SMALL.max_connections)]
    await until(lambda: api.guard.open_connections == SMALL.max_connections, 2.0, what="every connection admitted")
    with caplog.at_level(logging.WARNING, logger="ctrps.limits"):
        over = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        closed = await asyncio.gather(*(_closed_within(r, 0.2) for r, _ in over))
    assert all(c == b"" for c in closed), "a connection over the cap was kept"
    assert api.guard.stats()["refused_total"] == 5
    assert len([r for r in caplog.records if "connection cap of 20 reached" in r.getMessage()]) == 1
    for _, w in held + over:
        w.close()
    # Once the idle ones are gone (head deadline), the port serves again.
    await until(lambda: api.guard.open_connections == 0, 3.0, what="the idle connections closed")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api.url}/healthz") as resp:
            assert resp.status == 200


async def test_a_chunked_body_that_never_comes_gets_408(api: ApiServer) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", _port(api))
    w.write(
        b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nffffffff\r\n"
    )
    got = await _closed_within(r, 3.0)
    assert got is not None, "the request hung"
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"body_timeout" in got
    assert api.guard.stats()["body_timeouts_total"] == 1
    w.close()


async def test_a_body_over_the_limit_arriving_after_its_head_gets_a_json_413(patient_api: ApiServer) -> None:
    # A body this size comes in many packets, so the port guard reads it under
    # the body deadline; the refusal must still be the API's JSON error, counted.
    api = patient_api
    big = b'{"events": [{"features": {"x": "' + b"y" * (api.settings.max_body_bytes + 100_000) + b'"}}]}'
    async with aiohttp.ClientSession() as http:
        post = http.post(api.url + "/v1/predict", data=io.BytesIO(big), headers={"Content-Type": "application/json"})
        async with post as resp:
            assert resp.status == 413 and resp.content_type == "application/json"
            body = await resp.json()
        async with http.get(api.url + "/metrics") as resp:
            scraped = await resp.text()
    assert body["error"] == "too_large" and str(api.settings.max_body_bytes) in body["detail"]
    assert 'ctrps_http_requests_total{route="/v1/predict",status="413"} 1.0' in scraped


async def test_an_idle_kept_alive_connection_is_closed(api: ApiServer) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", _port(api))
    w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2.0)
    assert head.startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    assert await _closed_within(r, 3.0) is not None
    assert time.monotonic() - started >= SMALL.idle_timeout_s * 0.8  # not before its idle time
    w.close()


@pytest.mark.slow
async def test_a_busy_kept_alive_connection_stays_open_past_every_deadline(api: ApiServer) -> None:
    # Each request moves the connection's deadline: one that keeps asking,
    # for longer than the head and idle deadlines together, is never closed.
    r, w = await asyncio.open_connection("127.0.0.1", _port(api))
    started = last = time.monotonic()
    answered = 0
    while time.monotonic() - started < 3 * (SMALL.header_timeout_s + SMALL.idle_timeout_s):
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2.0)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await asyncio.wait_for(r.readexactly(length), 2.0)
        answered, last = answered + 1, time.monotonic()
        await asyncio.sleep(SMALL.idle_timeout_s * 0.4)  # the client's pause between requests, not a wait
    assert answered >= 5
    assert api.guard.stats()["head_timeouts_total"] == 0
    # Once it stops asking, its idle deadline (from the last answer) closes it.
    assert await _closed_within(r, 3.0) is not None
    assert time.monotonic() - last >= SMALL.idle_timeout_s * 0.8
    w.close()


async def test_the_shard_http_port_closes_half_open_requests() -> None:
    shard = Shard(ShardSpec(0, 1), [LR])
    app = create_shard_app(shard)
    guard = PortGuard("shard", SMALL)
    guard.install(app)
    runner = web.AppRunner(app, access_log=None, **SMALL.runner_kwargs())
    await runner.setup()
    served = await serve_limited(runner, guard, "127.0.0.1", 0)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", served.port)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{served.port}/v1/tables") as resp:
                assert resp.status == 200
        assert await _closed_within(r, 3.0) is not None
        assert guard.stats()["head_timeouts_total"] == 1
        w.close()
    finally:
        await served.close()


def test_limits_come_from_the_environment_and_bad_ones_are_refused() -> None:
    env = {"CTRPS_API_MAX_CONNECTIONS": "7", "CTRPS_API_HEADER_TIMEOUT": "2.5"}
    limits = port_limits_from_env(env, "CTRPS_API")
    assert (limits.max_connections, limits.header_timeout_s) == (7, 2.5)
    rpc = rpc_limits_from_env({"CTRPS_RPC_BUFFER_BUDGET_MB": "64", "CTRPS_RPC_HELLO_TIMEOUT": "1"})
    assert (rpc.buffer_budget_bytes, rpc.hello_timeout_s) == (64 << 20, 1.0)
    with pytest.raises(SettingsError, match="CTRPS_API"):
        port_limits_from_env({"CTRPS_API_BODY_TIMEOUT": "0"}, "CTRPS_API")
    with pytest.raises(SettingsError):
        rpc_limits_from_env({"CTRPS_RPC_MAX_CONNECTIONS": "0"})


# -- the RPC --------------------------------------------------------------------


async def _rpc(limits: RpcLimits, max_body: int = 512 << 20) -> tuple[Shard, RpcServer]:
    shard = Shard(ShardSpec(0, 1), [LR])
    return shard, await start_rpc_server(shard, "127.0.0.1", 0, max_body=max_body, limits=limits)


def _hello() -> bytes:
    # Packed here as the wire format says: magic, version, an empty token.
    return struct.pack("<8sIH", MAGIC, PROTOCOL_VERSION, 0)


async def test_rpc_connections_that_never_greet_are_closed(caplog: pytest.LogCaptureFixture) -> None:
    _, server = await _rpc(RpcLimits(hello_timeout_s=0.3))
    try:
        # (Not all 300 need be open at once: on a loaded machine the first may
        # time out before the last is accepted.)
        with caplog.at_level(logging.WARNING, logger="ctrps.limits"):
            conns = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(300)]
            closed = await asyncio.gather(*(_closed_within(r, 10.0) for r, _ in conns))
        assert all(c is not None for c in closed), "a connection that never greeted stayed open"
        await until(lambda: server.stats()["hello_timeouts_total"] == 300, 5.0, what="300 hello timeouts")
        assert server.stats()["open_connections"] == 0
        assert len([r for r in caplog.records if "sent no hello" in r.getMessage()]) == 1
        for _, w in conns:
            w.close()
    finally:
        await server.close()


async def test_rpc_frames_announced_huge_and_trickled_stay_within_the_budget() -> None:
    budget = 1 << 30
    _, server = await _rpc(RpcLimits(frame_timeout_s=0.5, buffer_budget_bytes=budget))
    try:
        conns = []
        for _ in range(8):
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(_hello() + struct.pack("<I", 512 << 20) + b"\x00" * 1024)  # 512 MiB announced, 1 KiB sent
            await w.drain()
            conns.append((r, w))
        await until(
            lambda: (
                server.stats()["overloaded_total"] == 6 and server.stats()["buffered_frame_bytes"] == 2 * (512 << 20)
            ),
            2.0,
            what="two frames held and six refused",
        )
        stats = server.stats()
        # Two frames fit the budget; six were refused with 503 overloaded.
        assert stats["buffered_frame_bytes"] <= budget
        assert stats["overloaded_total"] == 6
        replies = await asyncio.gather(*(_closed_within(r, 3.0) for r, _ in conns))
        assert all(got is not None for got in replies)
        overloaded = [got for got in replies if got and b"overloaded" in got]
        assert len(overloaded) == 6
        # The two that held the budget are cut off at the frame deadline, and give it back.
        assert server.stats()["frame_timeouts_total"] == 2
        assert server.stats()["buffered_frame_bytes"] == 0
        for _, w in conns:
            w.close()
    finally:
        await server.close()


async def test_rpc_serves_real_calls_under_limits_and_caps_connections(caplog: pytest.LogCaptureFixture) -> None:
    shard, server = await _rpc(RpcLimits(max_connections=3, hello_timeout_s=0.5, frame_timeout_s=0.5))
    try:
        conn = await RpcConnection.open("127.0.0.1", server.port)
        keys = np.arange(1, 200_001, dtype=np.uint64)  # 1.6 MB: a frame of several reads
        status, payload = await conn.call("/v1/pull", op_encoders.encode_pull("ctr_lr", keys))
        assert status == 200
        values = codec.decode(payload).values
        assert values is not None and values.shape == (keys.size, 1)
        assert server.stats()["buffered_frame_bytes"] == 0  # given back once whole
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        with caplog.at_level(logging.WARNING, logger="ctrps.limits"):
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            assert await _closed_within(r, 0.5) == b""
        assert server.stats()["refused_total"] == 1
        assert any("connection cap of 3" in rec.getMessage() for rec in caplog.records)
        assert conn.is_open
        for _, hw in held:
            hw.close()
        w.close()
        await conn.close()
    finally:
        await server.close()
