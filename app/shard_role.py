"""The shard-server role: a `Shard` behind its aiohttp app and its TCP RPC, until signalled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import aiohttp
from aiohttp import web

from ps_core.client import HttpTransport, LocalTransport, PSClient, RetryPolicy, ShardTransport
from ps_core.coordinator import Coordinator
from ps_core.coordinator_server import add_coordinator_routes
from ps_core.export import latest_chain, list_versions, restore_shards
from ps_core.exporter import Exporter
from ps_core.http1_server import start_shard_http
from ps_core.rpc import start_rpc_server
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


def _restore(settings: ShardSettings) -> tuple[Shard, int, dict[str, dict[int, int]]]:
    """This shard's slice of the newest whole export (or an empty shard), the
    newest version on disk, and the restored cut's offsets."""
    spec = ShardSpec(settings.shard_id, settings.num_shards)
    model_dir = Path(settings.exports_dir) / settings.model_name
    versions = list_versions(model_dir) if settings.exports_dir and model_dir.is_dir() else []
    newest = versions[-1].version if versions else 0
    if not (settings.restore and versions):
        return Shard(spec, settings.tables), newest, {}
    chain = latest_chain(model_dir, fallback=True, verify=True)
    result = restore_shards(chain, settings.num_shards, shard_ids=[settings.shard_id])
    shard = result.shards[0]
    for config in settings.tables:
        shard.declare(config)
    log_event(
        log, "restored", version=result.version, chain=",".join(str(v.version) for v in chain),
        rows=sum(len(t) for t in shard.tables.values()), shard_id=settings.shard_id,
    )
    return shard, newest, {t: dict(p) for t, p in result.offsets.items()}


def _hosts_coordinator(settings: ShardSettings) -> bool:
    if settings.shard_id != 0 or not settings.exports_dir:
        return False
    if settings.num_shards > 1 and not settings.shards:
        log_event(log, "no coordinator: shard 0 needs --shards (every shard's URL) to export")
        return False
    return True


async def run_shard(settings: ShardSettings, stop: asyncio.Event | None = None) -> None:
    """Serve one shard until SIGTERM/SIGINT (or `stop` is set), then close cleanly.

    Every shard first restores its slice of the newest export; shard 0 hosts
    the coordinator and exports on an interval (when it knows every shard)."""
    shard, newest, offsets = await asyncio.to_thread(_restore, settings)
    max_body = settings.max_body_mb * 1024 * 1024
    # The RPC first: the HTTP app advertises its port.
    rpc = (
        await start_rpc_server(shard, settings.host, settings.rpc_port, max_body=max_body)
        if settings.rpc
        else None
    )
    app = create_shard_app(shard, max_body=max_body, rpc_port=rpc.port if rpc is not None else None)
    client: PSClient | None = None
    exporter: Exporter | None = None
    if _hosts_coordinator(settings):
        # Versions continue after the newest on disk; its first cut is a base.
        coordinator = Coordinator(
            lease_ttl_s=settings.lease_ttl_s, base_every=settings.base_every,
            last_version=newest, offsets=offsets,
        )
        session = aiohttp.ClientSession(skip_auto_headers=("User-Agent",))
        transports: list[ShardTransport] = [LocalTransport(shard, coordinator)]
        transports += [
            HttpTransport(i, url, session, RetryPolicy()) for i, url in enumerate(settings.shards) if i > 0
        ]
        client = PSClient(transports, session=session)
        exporter = Exporter(
            coordinator, client, settings.exports_dir, settings.model_name, keep_bases=settings.keep_bases
        )
        add_coordinator_routes(app, coordinator, exporter)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    # Frame requests are answered by the port's front, the rest by the app.
    try:
        http = await start_shard_http(runner, shard, settings.host, settings.port, max_body=max_body)
    except BaseException:  # e.g. the port in use: release what was opened, then report it
        await runner.cleanup()
        if rpc is not None:
            await rpc.close()
        if client is not None:
            await client.close()
        raise
    port = http.port  # the one the OS gave, when asked for 0
    stop = stop or asyncio.Event()
    log_event(
        log,
        "listening",
        url=f"http://{settings.host}:{port}",
        rpc_port=rpc.port if rpc is not None else "-",
        shard_id=settings.shard_id,
        num_shards=settings.num_shards,
        tables=",".join(t.name for t in settings.tables) or "-",
    )
    reporter = (
        asyncio.create_task(_report(shard, settings.stats_interval_s))
        if settings.stats_interval_s > 0
        else None
    )
    exporting = (
        asyncio.create_task(exporter.run(settings.export_interval_s, stop))
        if exporter is not None and settings.export_interval_s > 0
        else None
    )
    if exporter is not None:
        log_event(log, "coordinator", exports=str(exporter.model_dir),
                  interval_s=settings.export_interval_s, next_version=newest + 1)
    try:
        with stop_on_signals(stop):
            await stop.wait()
    finally:
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        if exporting is not None:
            await exporting  # returns once stop is set; an export under way finishes
        if rpc is not None:
            await rpc.close()
        await http.cleanup()
        if client is not None:
            await client.close()
        log_event(log, "stopped", shard_id=settings.shard_id)
