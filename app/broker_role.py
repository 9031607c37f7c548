"""The broker role: the embedded broker with its topics, until signalled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from consumers.broker import BrokerError, EmbeddedBroker
from consumers.broker_memory import BrokerMemory

from .logs import log_event
from .settings import BrokerSettings
from .signals import stop_on_signals

__all__ = ["run_broker"]

log = logging.getLogger("ctrps.broker")


@contextlib.asynccontextmanager
async def _metrics_site(memory: BrokerMemory, port: int) -> AsyncIterator[str | None]:
    """``GET /metrics`` of the broker's memory on 127.0.0.1:`port` while the
    block runs, and its URL; nothing (None) with port 0."""
    if not port:
        yield None
        return
    registry = CollectorRegistry()
    registry.register(memory)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        except OSError as exc:
            raise BrokerError(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}") from exc
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


async def run_broker(
    port: int, topics: dict[str, int], stop: asyncio.Event | None = None, settings: BrokerSettings = BrokerSettings()
) -> None:
    """Start the embedded broker, create `topics`, serve until SIGTERM/SIGINT;
    its resident memory is watched against ``settings.max_rss_mb`` (and
    served on ``settings.metrics_port``)."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        async with EmbeddedBroker(port=port) as broker:
            await broker.create_topics(topics)
            pid = broker.pid
            memory = BrokerMemory(lambda: pid, settings.max_rss_mb * 2**20)
            async with _metrics_site(memory, settings.metrics_port) as metrics_url:
                log_event(
                    log,
                    "ready",
                    bootstrap=broker.bootstrap,
                    pid=pid,
                    # New at every start: its memory, and so its offsets, are new too.
                    cluster_id=broker.cluster_id,
                    topics=",".join(f"{k}:{v}" for k, v in topics.items()),
                    max_rss_mb=settings.max_rss_mb,
                    metrics=metrics_url or "-",
                )
                await memory.watch(stop)
    log_event(log, "stopped")
