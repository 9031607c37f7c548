"""The shard-server role: a `Shard` behind its aiohttp app, until signalled."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from ps_core.server import create_shard_app
from ps_core.shard import Shard, ShardSpec

from .logs import log_event
from .settings import ShardSettings
from .signals import stop_on_signals

__all__ = ["run_shard"]

log = logging.getLogger("ctrps.shard")


async def _report(shard: Shard, interval_s: float) -> None:
    """A progress line per interval: features, bytes and pushes per table."""
    while True:
        await asyncio.sleep(interval_s)
        for name, t in shard.tables.items():
            log_event(
                log,
                "table",
                table=name,
                features=len(t),
                bytes=t.memory_bytes(),
                pushes=t.pushes,
                pulls=t.pulls,
            )


async def run_shard(settings: ShardSettings, stop: asyncio.Event | None = None) -> None:
    """Serve one shard until SIGTERM/SIGINT (or `stop` is set), then close cleanly."""
    shard = Shard(ShardSpec(settings.shard_id, settings.num_shards), settings.tables)
    app = create_shard_app(shard, max_body=settings.max_body_mb * 1024 * 1024)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    await site.start()
    port = settings.port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        # Port 0 asked the OS for a free port: report the one it gave.
        port = sockets[0].getsockname()[1]
    stop = stop or asyncio.Event()
    log_event(
        log,
        "listening",
        url=f"http://{settings.host}:{port}",
        shard_id=settings.shard_id,
        num_shards=settings.num_shards,
        tables=",".join(t.name for t in settings.tables) or "-",
    )
    reporter = (
        asyncio.create_task(_report(shard, settings.stats_interval_s))
        if settings.stats_interval_s > 0
        else None
    )
    try:
        with stop_on_signals(stop):
            await stop.wait()
    finally:
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        await runner.cleanup()
        log_event(log, "stopped", shard_id=settings.shard_id)
