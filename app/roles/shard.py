"""The shard-server role: a `Shard` behind its aiohttp app and its TCP RPC, until signalled."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from ps_core.checkpoint.control import ControlClient, HttpControl, LocalControl, ShardControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import dir_mode
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.exportstore import ExportStoreError, S3ExportStore, StoredModel, store_for
from ps_core.checkpoint.joining import (
    ModelAt,
    books_at,
    model_versions,
    newest_loadable,
    refusal_fields,
    restore_chains,
)
from ps_core.checkpoint.membership import Membership
from ps_core.checkpoint.owner import HAND_STARTED, claim_exports
from ps_core.checkpoint.routes import add_coordinator_routes, checkpointed_shard_app
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.net.auth import Refusals, Scope, TokenVerifier
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.rpc import RpcServer, start_rpc_server
from ps_core.net.server import start_shard_site
from ps_core.net.tls import HandshakeFailures, watch_handshakes
from ps_core.shard import Shard, ShardSpec
from ps_core.waits import cancelled

from ..config.shard import ShardSettings
from ..failures import ExpectedFailure
from ..logs import log_event
from ..security import SecuritySettings
from ..signals import stop_on_signals

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


async def _evict(shard: Shard, interval_s: float) -> None:
    """An eviction pass per interval over every table with eviction rules,
    in steps that let the event loop run between them
    (`SparseTable.eviction_steps`); a line per table that lost rows."""
    while True:
        await asyncio.sleep(interval_s)
        for name, table in list(shard.tables.items()):
            if not table.lifecycle.evicts:
                continue
            for _ in table.eviction_steps():
                await asyncio.sleep(0)  # pulls, pushes and cuts run between steps
            report = table.last_eviction
            if report is not None and report.removed:
                log_event(
                    log,
                    "evicted",
                    table=name,
                    rows=report.removed,
                    **report.by_rule,
                    bytes_freed=report.bytes_freed,
                    pause_ms=round(report.pause_ms, 1),
                    features=len(shard.tables[name]),
                )


Books = dict[str, tuple[dict[str, dict[int, int]], StreamIdentity | None]]


def _is_bucket(exports: str) -> bool:
    return "://" in exports


def _model_at(settings: ShardSettings) -> ModelAt | None:
    """The model's exports: ``<exports-dir>/<model>``, or the model in the
    ``s3://bucket/prefix`` bucket; None without exports."""
    if not settings.exports_dir:
        return None
    if _is_bucket(settings.exports_dir):
        return StoredModel(store_for(settings.exports_dir), settings.model_name)
    return Path(settings.exports_dir) / settings.model_name


def _restore(settings: ShardSettings) -> tuple[Shard, int, Books]:
    """This shard's slice of the newest export every file of which checks
    in every model (or an empty shard), the newest version on disk, and the
    restored cut's offsets with their stream, per model. A version passed
    over is logged (``version refused``: file and both checksums); in a
    cluster of several shards, whether that fallback stands is the
    coordinator's decision, made for every shard together."""
    spec = ShardSpec(settings.shard_id, settings.num_shards)
    model_dir = _model_at(settings)
    versions = model_versions(model_dir) if model_dir is not None else {}
    newest = max(versions, default=0)
    shard = Shard(
        spec,
        settings.tables,
        lifecycle=settings.default_lifecycle(),
        change_log_keys=settings.geo_change_log_keys,
        restore_dir=model_dir,
        restores_at_start=settings.restore,
    )
    if settings.restore and versions and model_dir is not None:
        chains, refusals = newest_loadable(model_dir)
        for exc in refusals:
            log.warning("version refused", extra={"fields": {"shard_id": settings.shard_id, **refusal_fields(exc)}})
        if chains is None:
            log.warning(
                "nothing to restore: no version loads",
                extra={"fields": {"exports": str(model_dir), "shard_id": settings.shard_id}},
            )
        else:
            chain = chains[settings.model_name]
            result = restore_chains(chains, settings.num_shards, [settings.shard_id])
            shard = result.shards[0]
            shard.reconfigure(settings.tables, settings.default_lifecycle())
            shard.restored(result.version, model_dir)
            log_event(
                log,
                "restore",
                version=result.version,
                chain=",".join(str(v.version) for v in chain),
                models=",".join(chains),
                rows=sum(len(t) for t in shard.tables.values()),
                shard_id=settings.shard_id,
                cluster_id=result.manifest.stream.cluster_id if result.manifest.stream is not None else "-",
            )
            return shard, newest, books_at(chains)
    return shard, newest, {}


def _joins(settings: ShardSettings) -> bool:
    """Whether this shard starts unjoined, to be admitted by the coordinator:
    a restoring shard of several, unless it is a shard 0 that hosts none."""
    if settings.num_shards == 1 or not settings.exports_dir:
        return False
    if settings.shard_id == 0:
        return _hosts_coordinator(settings, quiet=True)
    return settings.restore


async def _wait_for_admission(shard: Shard, every_s: float = 5.0) -> None:
    """One line every `every_s` while the shard is not joined, saying what it waits for."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        if shard.joined:
            continue
        now = time.monotonic()
        heard = shard.last_contact
        log.warning(
            "not joined",
            extra={
                "fields": {
                    "shard_id": shard.spec.shard_id,
                    "version": shard.state_version,
                    "waiting_s": round(now - started),
                    "coordinator_last_seen_s": round(now - heard) if heard else "never",
                    "hint": "serving no pulls or pushes until shard 0's coordinator admits this shard; "
                    "if shard 0 is not running, start it with --shards listing every shard's URL",
                }
            },
        )


def _claim_exports(settings: ShardSettings) -> None:
    """Shard 0 makes the exports directory its cluster's (`claim_exports`);
    `ExportsOwnedError` (exit 4) when another cluster owns it and
    ``--take-over-exports`` was not given."""
    owner = settings.exports_owner or HAND_STARTED
    record, took_over = claim_exports(
        settings.exports_dir if _is_bucket(settings.exports_dir) else Path(settings.exports_dir),
        owner,
        "ctrps shard",
        take_over=settings.take_over_exports,
        file_mode=settings.exports_mode,
    )
    fields = {"exports": settings.exports_dir, "owner": record.owner, "since": record.since}
    if took_over:
        log.warning("took over the exports directory", extra={"fields": {**fields, "taken_from": record.taken_from}})
    else:
        log_event(log, "exports claimed", **fields)


def _hosts_coordinator(settings: ShardSettings, quiet: bool = False) -> bool:
    if settings.shard_id != 0 or not settings.exports_dir:
        return False
    if settings.num_shards > 1 and not settings.shards:
        if not quiet:
            log_event(log, "no coordinator: shard 0 needs --shards (every shard's URL) to export")
        return False
    return True


class ExportsDirError(ExpectedFailure):
    """The exports directory of the shard that writes them cannot be written (exit 1)."""


def _check_exports_dir(settings: ShardSettings) -> None:
    """The exports directory, where this shard writes versions: made if
    absent (as an export makes it) and written to once, so that a directory
    that cannot hold exports fails the start in one line, not every export.
    A bucket is written to once the same way (within the store's timeouts)."""
    if _is_bucket(settings.exports_dir):
        try:
            store = store_for(settings.exports_dir)
            if isinstance(store, S3ExportStore):  # the settings admit no other scheme
                store.check_writable()
        except ExportStoreError as exc:
            raise ExportsDirError(
                f"exports {settings.exports_dir} cannot be written: {exc} (--exports-dir; --no-exports for none)"
            ) from None
        return
    root = Path(settings.exports_dir)
    try:
        root.mkdir(mode=dir_mode(settings.exports_mode), parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ExportsDirError(
            f"exports directory {root} cannot be written: {exc.strerror or exc} (--exports-dir; --no-exports for none)"
        ) from None


async def _restored_shard(settings: ShardSettings) -> tuple[Shard, int, Books]:
    """`_restore` after the exports directory's checks (and, on shard 0, its
    claim); the shard left unjoined when the coordinator is to admit it."""
    if _hosts_coordinator(settings, quiet=True):
        await asyncio.to_thread(_check_exports_dir, settings)
    if settings.shard_id == 0 and settings.exports_dir:
        # Before the restore: another cluster's models are neither restored nor pruned.
        await asyncio.to_thread(_claim_exports, settings)
    try:
        shard, newest, books = await asyncio.to_thread(_restore, settings)
    except ExportStoreError as exc:  # a bucket's listing or a file's read failed (after its retries)
        raise ExportsDirError(
            f"exports {settings.exports_dir} cannot be read: {exc} (--exports-dir; --no-exports for none)"
        ) from None
    if _joins(settings):
        shard.leave(f"it restored version {shard.state_version} and waits for the coordinator (shard 0) to admit it")
    return shard, newest, books


def _coordination(
    settings: ShardSettings,
    shard: Shard,
    app: web.Application,
    newest: int,
    books: Books,
    offsets: dict[str, dict[int, int]],
    stream: StreamIdentity | None,
    admin_token: str,
    client_tls: ssl.SSLContext | None,
) -> tuple[ControlClient, Exporter, Membership | None]:
    """What shard 0 hosts: the coordinator and its routes, the exporter over
    every shard (reached as an admin), and in a cluster of several the
    membership rounds that join restored shards."""
    # Versions continue after the newest on disk; its first cut is a base.
    coordinator = Coordinator(
        lease_ttl_s=settings.lease_ttl_s,
        base_every=settings.base_every,
        last_version=newest,
        offsets=offsets,
        version=shard.state_version,
        stream=stream,
        model=settings.model_name,
        books=books,
    )
    session = aiohttp.ClientSession(skip_auto_headers=("User-Agent",))

    def peer(i: int, url: str, deadline_s: float = 10.0) -> HttpControl:
        return HttpControl(i, url, session, RetryPolicy(deadline_s=deadline_s), token=admin_token, ssl=client_tls)

    shards: list[ShardControl] = [LocalControl(shard, coordinator)]
    shards += [peer(i, url) for i, url in enumerate(settings.shards) if i > 0]
    client = ControlClient(shards, session=session)
    exporter = Exporter(
        coordinator,
        client,
        settings.exports_dir,
        settings.model_name,
        keep_bases=settings.keep_bases,
        serving_precision=settings.serving_precision,
        file_mode=settings.exports_mode,
    )
    add_coordinator_routes(app, coordinator, exporter)
    shard.add_stats("exports", exporter.stats)
    shard.add_stats("sync", coordinator.sync_stats)
    if settings.num_shards == 1:
        return client, exporter, None
    # Every shard at one version, or no leases (ps_core/checkpoint/membership.py).
    # Membership polls give up quickly (a shard down is a round
    # missed); a load of every shard's chain may take minutes.
    quick = ControlClient([shards[0]] + [peer(i, url, 2.0) for i, url in enumerate(settings.shards) if i > 0])
    slow = ControlClient([shards[0]] + [peer(i, url, 900.0) for i, url in enumerate(settings.shards) if i > 0])
    membership = Membership(
        coordinator, quick, exporter.dir_of(), urls=settings.shards, restore_client=slow, files_lock=exporter.lock
    )
    shard.add_stats("cluster", membership.stats)
    return client, exporter, membership


async def _until_stopped(
    settings: ShardSettings,
    shard: Shard,
    stop: asyncio.Event,
    exporter: Exporter | None,
    membership: Membership | None,
    newest: int,
) -> None:
    """Run the shard's background tasks (stats lines, eviction, exports,
    joining, the wait for admission) until `stop` or a signal; then stop
    them, letting an export under way finish."""
    reporter = asyncio.create_task(_report(shard, settings.stats_interval_s)) if settings.stats_interval_s > 0 else None
    evicting = asyncio.create_task(_evict(shard, settings.evict_interval_s)) if settings.evict_interval_s > 0 else None
    exporting = (
        asyncio.create_task(exporter.run(settings.export_interval_s, stop))
        if exporter is not None and settings.export_interval_s > 0
        else None
    )
    joining = asyncio.create_task(membership.run(stop)) if membership is not None else None
    waiting = asyncio.create_task(_wait_for_admission(shard))
    if exporter is not None:
        log_event(
            log,
            "coordinator",
            exports=str(exporter.dir_of()),
            interval_s=settings.export_interval_s,
            next_version=newest + 1,
        )
    try:
        with stop_on_signals(stop):
            await stop.wait()
    finally:
        for task in (reporter, evicting, waiting):
            if task is not None:
                await cancelled(task)
        if exporting is not None:
            await exporting  # returns once stop is set; an export under way finishes
        if joining is not None:
            await joining  # returns once stop is set


async def _start_rpc(
    settings: ShardSettings,
    shard: Shard,
    max_body: int,
    verifier: TokenVerifier | None,
    refusals: Refusals,
    server_tls: ssl.SSLContext | None,
) -> RpcServer | None:
    """The shard's TCP RPC server, unless ``--no-rpc``."""
    if not settings.rpc:
        return None
    return await start_rpc_server(
        shard,
        settings.host,
        settings.rpc_port,
        max_body=max_body,
        limits=settings.rpc_limits,
        verifier=verifier,
        refusals=refusals,
        ssl=server_tls,
    )


async def run_shard(
    settings: ShardSettings, stop: asyncio.Event | None = None, *, security: SecuritySettings | None = None
) -> None:
    """Serve one shard until SIGTERM/SIGINT (or `stop` is set), then close cleanly.

    Every shard first restores its slice of the newest export; shard 0 hosts
    the coordinator and exports on an interval (when it knows every shard).
    With `security`'s cluster secret every route but ``/healthz`` and the RPC
    need tokens; with its certificate both ports serve TLS. A non-loopback
    host without a secret is refused (`SettingsError`) unless ``--insecure``."""
    security = security or SecuritySettings()
    security.check_exposed("shard", settings.host, has_credentials=bool(security.cluster_secret))
    verifier = security.verifier()
    server_tls = security.server_tls()
    handshakes = HandshakeFailures()
    if server_tls is not None:
        watch_handshakes(server_tls, handshakes)
    # Shard 0 calls the other shards as an admin, verifying them like any client.
    admin_token = verifier.token(Scope.ADMIN) if verifier is not None else security.token_for(Scope.ADMIN)
    client_tls = security.client_tls()
    refusals = Refusals(logging.getLogger("ctrps.shard.auth"))
    shard, newest, books = await _restored_shard(settings)
    offsets, stream = books.pop(settings.model_name, ({}, None))
    max_body = settings.max_body_mb * 1024 * 1024
    # The RPC first: the HTTP app advertises its port.
    rpc = await _start_rpc(settings, shard, max_body, verifier, refusals, server_tls)
    app = checkpointed_shard_app(
        shard, max_body=max_body, rpc_port=rpc.port if rpc is not None else None, verifier=verifier, refusals=refusals
    )

    client, exporter, membership = (
        _coordination(settings, shard, app, newest, books, offsets, stream, admin_token, client_tls)
        if _hosts_coordinator(settings)
        else (None, None, None)
    )
    try:
        http = await start_shard_site(
            app, settings.host, settings.port, ssl_context=server_tls, limits=settings.http_limits
        )
    except BaseException:  # e.g. the port in use: release what was opened, then report it
        if rpc is not None:
            await rpc.close()
        if client is not None:
            await client.close()
        raise
    port = http.port  # the one the OS gave, when asked for 0
    # The ports' connections and what their limits refused (the API relays them as metrics).
    shard.add_stats(
        "ports",
        lambda: {
            "http": http.guard.stats(),
            **({"rpc": rpc.stats()} if rpc is not None else {}),
            "tls": handshakes.stats(),
        },
    )
    stop = stop or asyncio.Event()
    log_event(
        log,
        "listening",
        url=f"{'https' if server_tls is not None else 'http'}://{settings.host}:{port}",
        rpc_port=rpc.port if rpc is not None else "-",
        auth="on" if verifier is not None else "off",
        tls="mutual" if security.tls.require_client_cert else ("on" if server_tls is not None else "off"),
        shard_id=settings.shard_id,
        num_shards=settings.num_shards,
        tables=",".join(t.name for t in settings.tables) or "-",
    )
    try:
        await _until_stopped(settings, shard, stop, exporter, membership, newest)
    finally:
        if rpc is not None:
            await rpc.close()
        await http.cleanup()
        if client is not None:
            await client.close()
        log_event(log, "stopped", shard_id=settings.shard_id)
