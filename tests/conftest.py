"""Shared fixtures: shard servers on loopback (in-process, free ports), a
real Kafka-protocol broker, and logging put back after a test."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from s3_server import S3Endpoint, moto_installed, moto_server

from app.logs import KAFKA_LOGGERS
from consumers.broker import PORT_BAND_VAR, EmbeddedBroker, port_band, wait_for_metadata
from ps_core.checkpoint.control import ControlClient, HttpControl, LocalControl, ShardControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.routes import checkpointed_shard_app
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.rpc import RpcServer, start_rpc_server
from ps_core.net.server import DEFAULT_MAX_BODY, ShardSite, start_shard_site
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

ServeShards = Callable[..., Awaitable[tuple[list[Shard], list[str]]]]


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` (xdist), each runner draws ports from its own
    band of `free_port`'s, and so do the roles it starts (the variable is
    inherited): two runners never pick the same port at the same moment."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    band = port_band()
    if worker.startswith("gw") and band is not None and PORT_BAND_VAR not in os.environ:
        low, high = band
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        width = (high - low) // max(1, count)
        start = low + int(worker[2:]) * width
        os.environ[PORT_BAND_VAR] = f"{start}-{start + width - 1}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `kafka` every test that uses the session broker (`kafka_bootstrap`,
    directly or through another fixture), so ``-m "not kafka"`` runs without
    one; tests that start a broker of their own carry the mark themselves."""
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture
async def serve_shards() -> AsyncIterator[ServeShards]:
    """Start `n` shard servers on 127.0.0.1 (free ports); returns (shards, urls).

    All are stopped at teardown; a test may stop one earlier through
    ``serve_shards.runners[i].cleanup()``."""
    runners: list[ShardSite | web.AppRunner] = []

    async def start(
        n: int, tables: tuple[TableConfig, ...] = (), exports: Path | None = None, rpc: bool = False
    ) -> tuple[list[Shard], list[str]]:
        """With `exports`, shard 0 hosts a coordinator and an exporter writing
        there, as ``ctrps shard --shards ...`` does; with `rpc`, each shard
        also serves its TCP RPC and advertises it, as ``ctrps shard`` does."""
        # Bound to port 0, shard 0 last: only its exporter needs the others'
        # URLs, and no port is picked before the server that binds it.
        shards = [Shard(ShardSpec(i, n), tables) for i in range(n)]
        urls = [""] * n
        sites: list[ShardSite | None] = [None] * n
        try:
            await start_each(shards, urls, sites, exports, rpc)
        finally:
            runners.extend(site for site in sites if site is not None)
        return shards, urls

    async def start_each(
        shards: list[Shard], urls: list[str], sites: list[ShardSite | None], exports: Path | None, rpc: bool
    ) -> None:
        for i in reversed(range(len(shards))):
            shard = shards[i]
            rpc_port = None
            if rpc:
                server = await start_rpc_server(shard, "127.0.0.1", 0, max_body=DEFAULT_MAX_BODY)
                rpc_servers.append(server)
                rpc_port = server.port
            if i == 0 and exports is not None:
                coordinator = Coordinator()
                session = aiohttp.ClientSession()
                sessions.append(session)
                peers: list[ShardControl] = [LocalControl(shard, coordinator)]
                peers += [HttpControl(j, u, session, RetryPolicy()) for j, u in enumerate(urls) if j]
                exporter = Exporter(coordinator, ControlClient(peers), exports, "ctr")
                shard.add_stats("exports", exporter.stats)  # its figures in the stats and /metrics
                app = checkpointed_shard_app(shard, rpc_port=rpc_port, coordinator=coordinator, exporter=exporter)
            else:
                app = checkpointed_shard_app(shard, rpc_port=rpc_port)
            # The port as `ctrps shard` serves it, under its limits.
            site = sites[i] = await start_shard_site(app, "127.0.0.1", 0)
            urls[i] = f"http://127.0.0.1:{site.port}"

    sessions: list[aiohttp.ClientSession] = []
    rpc_servers: list[RpcServer] = []
    start.runners = runners  # type: ignore[attr-defined]
    start.rpc_servers = rpc_servers  # type: ignore[attr-defined]
    yield start
    for server in rpc_servers:
        await server.close()
    for r in runners:
        await r.cleanup()
    for s in sessions:
        await s.close()


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


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The root and Kafka loggers as they were before the test, which may
    configure logging as the CLI does."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    kafka = {name: logging.getLogger(name).level for name in KAFKA_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in kafka.items():
        logging.getLogger(name).setLevel(lvl)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """A real S3-protocol server (moto's, a subprocess on a free loopback port)
    for the session, with an empty bucket: its URL, bucket and credentials as
    AWS environment variables. Stopped at the session's end; skips its users
    where moto is not installed."""
    if not moto_installed():
        pytest.skip("moto is not installed (pip install 'moto[server]', in the dev extras)")
    with moto_server() as endpoint:
        yield endpoint
