"""Shared fixtures: shard servers on loopback (in-process, free ports) and a
real Kafka-protocol broker."""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from consumers.broker import EmbeddedBroker, wait_for_metadata
from ps_core.server import create_shard_app
from ps_core.shard import Shard, ShardSpec
from ps_core.table import TableConfig

ServeShards = Callable[..., Awaitable[tuple[list[Shard], list[str]]]]


@pytest.fixture
async def serve_shards() -> AsyncIterator[ServeShards]:
    """Start `n` shard servers on 127.0.0.1 (free ports); returns (shards, urls).

    All are stopped at teardown; a test may stop one earlier through
    ``serve_shards.runners[i].cleanup()``."""
    runners: list[web.AppRunner] = []

    async def start(n: int, tables: tuple[TableConfig, ...] = ()) -> tuple[list[Shard], list[str]]:
        shards, urls = [], []
        for i in range(n):
            shard = Shard(ShardSpec(i, n), tables)
            runner = web.AppRunner(create_shard_app(shard), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            assert site._server is not None
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            shards.append(shard)
            urls.append(f"http://127.0.0.1:{port}")
            runners.append(runner)
        return shards, urls

    start.runners = runners  # type: ignore[attr-defined]
    yield start
    for r in runners:
        await r.cleanup()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """A real Kafka-protocol broker for the whole session.

    `CTRPS_KAFKA_BOOTSTRAP` names an external broker (e.g. Apache Kafka);
    otherwise the embedded Tansu broker is started on a free loopback port."""
    external = os.environ.get("CTRPS_KAFKA_BOOTSTRAP")
    if external:
        asyncio.run(wait_for_metadata(external))
        yield external
        return
    broker = EmbeddedBroker()
    asyncio.run(broker.start())
    try:
        yield broker.bootstrap
    finally:
        broker.stop()
