"""``ctrps demo``: the whole pipeline in one process, nothing else to start.

- Kafka: the embedded broker (`consumers.broker.EmbeddedBroker`, memory only),
  or the broker at ``CTRPS_KAFKA_BOOTSTRAP``; topics ``clicks`` (4 partitions)
  and ``clicks.dlq``.
- A producer task sends the synthetic stream (`ps_core.synthetic`) at a
  steady rate, event time following wall time.
- N shards in this process (`PSClient.local`), a worker with short windows
  (group ``ctrps-demo``), and the HTTP API on ``--port``.

The shards are objects in this process, not servers: the demo opens no
shard port, so it has no cluster secret to hand out. The API's admin routes
take ``CTRPS_ADMIN_TOKEN`` (or ``_FILE``) as ``ctrps serve``'s do; without
one the demo makes a token for the run (`app.security.generated_admin_token`:
a 0600 file, named in the banner and the ``ready`` line; the text banner
shows the token itself), so no other local user can declare models or write
exports; ``--insecure`` leaves them open instead. On a non-loopback
``--host`` the demo refuses to start without a token of the user's own
unless ``--insecure``.

It prints the URLs and ``curl`` examples, then one progress line per window,
and stops cleanly on Ctrl-C/SIGTERM or after ``--duration``: producer first,
then the worker (which trains and commits its last window), the API, the
broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from consumers.broker import BrokerError, EmbeddedBroker, create_topics, wait_for_metadata
from consumers.broker_memory import BrokerMemory
from consumers.kafka_security import KafkaSecurity
from consumers.producer import produce
from consumers.worker import WindowReport, Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.owner import claim_exports, run_exports_dir
from ps_core.model.models import Model, make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

from .api.server import ApiServer
from .api.state import METRICS
from .config.declared import SettingsError
from .config.demo import DemoSettings
from .config.serve import ApiSettings
from .config.worker import WorkerSettings, worker_config
from .logs import log_event
from .security import GeneratedToken, generated_admin_token
from .signals import stop_on_signals
from .status import default_worker_id, make_status_hook

__all__ = [
    "run_demo",
    "api_settings_of",
    "worker_settings_of",
    "TOPIC",
    "GROUP",
    "PARTITIONS",
    "example_event",
    "fresh_exports_dir",
]

log = logging.getLogger("ctrps.demo")

TOPIC = "clicks"
"""The click topic; dead letters go to ``clicks.dlq``."""
GROUP = "ctrps-demo"
"""The demo worker's consumer group: apart from production ``ctrps`` workers
when the demo runs against a shared Kafka."""
PARTITIONS = 4
"""Partitions of the click topic when the demo creates it."""
WINDOW_EVENTS = 100_000
"""Most events in one window (the window's seconds bound it first at demo rates)."""


def example_event(seed: int) -> dict[str, Any]:
    """A short predict request event: some fields of the stream's first event,
    so the prediction reads weights the demo has learnt."""
    first = SyntheticStream(seed=seed).batch(1)[0]["features"]
    keep = ("C1", "C2", "C3", "C4", "C5", "C6", "I1", "I2")
    return {"features": {k: first[k] for k in keep if k in first}}


class _WindowProgress:
    """The per-window progress line: throughput over wall time (events_per_s:
    events trained since the previous line, over the seconds between them), the window's
    progressive log loss / AUC, features in the model."""

    def __init__(self, control: ControlClient, model: Model) -> None:
        self._control = control
        self._table = model.table_names[0]  # the linear table: one row per feature
        self._t = time.monotonic()
        self.trained = 0

    async def __call__(self, report: WindowReport) -> None:
        now = time.monotonic()
        rate = report.events / (now - self._t) if now > self._t else 0.0
        self._t = now
        self.trained += report.events
        stats = await self._control.stats()
        features = sum(s.tables[self._table].features for s in stats if self._table in s.tables)
        m = report.metrics
        log_event(
            log,
            "window",
            window=report.window,
            events=report.events,
            events_per_s=round(rate),
            logloss=round(m.logloss, 4),
            constant_logloss=round(_constant_logloss(m.ctr), 4),
            auc=round(m.auc, 4),
            copc=round(m.copc, 3),
            features=features,
            trained=self.trained,
            dlq=report.dlq,
            lag=report.lag,
        )


def _constant_logloss(ctr: float) -> float:
    """The log loss of always predicting a window's own click rate: what a
    model must beat to have learnt anything."""
    if not 0 < ctr < 1:
        return 0.0
    return float(-(ctr * math.log(ctr) + (1 - ctr) * math.log1p(-ctr)))


class _DropWorkerWindowLines(logging.Filter):
    """The demo's progress line replaces the worker's own window line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "window"


@contextlib.contextmanager
def _demo_logging() -> Iterator[None]:
    """One line per window, and no Kafka client chatter (group joins, ...)
    below warnings, while the demo runs."""
    worker_log, kafka_log = logging.getLogger("ctrps.worker"), logging.getLogger("aiokafka")
    drop, level = _DropWorkerWindowLines(), kafka_log.level
    worker_log.addFilter(drop)
    kafka_log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        worker_log.removeFilter(drop)
        kafka_log.setLevel(level)


def _hooks(
    *hooks: Callable[[WindowReport], Awaitable[None]],
) -> Callable[[WindowReport], Awaitable[None]]:
    """One `on_window` hook running `hooks` in order."""

    async def run(report: WindowReport) -> None:
        for hook in hooks:
            await hook(report)

    return run


def fresh_exports_dir(parent: Path) -> Path:
    """A directory of this run's own under `parent`:
    ``demo-<UTC time>-<random>``, created now (never one that exists) and
    claimed as this run's (`claim_exports`), so no other run — another demo,
    or shards restoring ``<parent>/<model>`` — shares its versions."""
    path = run_exports_dir(parent, "demo")
    claim_exports(path, path.name, "ctrps demo")
    return path


def _announce(
    out: TextIO,
    server: ApiServer,
    bootstrap: str,
    settings: DemoSettings,
    exports: Path | None = None,
    admin: GeneratedToken | None = None,
) -> None:
    """Where everything is and what to try: a banner on `out` for people, or,
    with JSON logs, one ``ready`` line holding the same (stdout stays empty).
    A token made for this run (`admin`) is shown in the banner only: the
    ``ready`` line names its file."""
    api = server.url
    body = orjson.dumps({"events": [example_event(settings.seed)]}).decode()
    served = {r.resource.canonical for r in server.app.router.routes() if r.resource is not None}
    urls = {"api": api, **({"dashboard": f"{api}/"} if "/" in served else {}), "metrics": f"{api}/metrics"}
    examples = [
        f"curl -s {api}/v1/model",
        f"curl -s -XPOST {api}/v1/predict -H 'Content-Type: application/json' -d '{body}'",
        f"curl -s {api}/metrics | grep ctrps_",
    ]
    if admin is not None and exports is not None:
        examples.append(f'curl -s -XPOST {api}/v1/exports -H "Authorization: Bearer $(cat {admin.path})"')
    given = "given" if server.settings.admin_token else "none"
    log_event(log, "ready", **urls, bootstrap=bootstrap, topic=TOPIC, group=GROUP,
              shards=settings.shards, rate=settings.rate, window_seconds=settings.window_seconds,
              exports=str(exports) if exports is not None else "-",
              admin_token="generated" if admin is not None else given,
              admin_token_file=str(admin.path) if admin is not None else "-",
              **({"examples": examples} if settings.log_format == "json" else {}))  # fmt: skip
    if settings.log_format == "json":
        return
    lines = [
        "",
        f"ctrps demo: synthetic clicks -> Kafka -> worker -> {settings.shards} shards -> HTTP API",
        *(f"  {'API' if name == 'api' else name:<10} {url}" for name, url in urls.items()),
        f"  {'kafka':<10} {bootstrap} (topic {TOPIC}, group {GROUP})",
        *([f"  {'exports':<10} {exports} (this run's own; the demo never restores)"] if exports is not None else []),
        *(
            [f"  {'admin':<10} {admin.token} (this run's admin token, also in {admin.path})"]
            if admin is not None
            else []
        ),
        "",
        "Try:",
        *(f"  {e}" for e in examples),
        "",
        f"One line per {settings.window_seconds:g}s window follows; Ctrl-C stops. logloss is progressive (each",
        "event predicted before it is learnt from); constant_logloss is what predicting the window's own click",
        "rate scores: the model must beat it to have learnt anything (a fresh one does from its first window).",
        "",
    ]
    out.write("\n".join(lines) + "\n")
    out.flush()


async def run_demo(
    settings: DemoSettings,
    stop: asyncio.Event | None = None,
    out: TextIO | None = None,
    *,
    kafka: KafkaSecurity = KafkaSecurity(),
) -> int:
    """Run the demo until SIGTERM/SIGINT, `stop` or ``duration_s`` after it is
    ready; returns the exit status (0 clean, 1 a part failed or could not start).

    `kafka` is how the worker and the producer reach the Kafka at
    ``settings.bootstrap``; the embedded broker speaks PLAINTEXT only, so
    other settings need a bootstrap (`SettingsError` otherwise)."""
    if kafka.security_protocol != "PLAINTEXT" and not settings.bootstrap:
        raise SettingsError(
            f"Kafka security protocol {kafka.security_protocol} needs --bootstrap: "
            "the embedded broker speaks PLAINTEXT only"
        )
    stop = stop or asyncio.Event()
    out = out or sys.stdout
    with stop_on_signals(stop), _demo_logging():
        try:
            return await _run(settings, stop, out, kafka)
        except (BrokerError, OSError) as exc:  # no broker, the API's port taken, ...
            log.error("could not start", extra={"fields": {"error": str(exc)}})
            return 1


def api_settings_of(settings: DemoSettings) -> ApiSettings:
    """The settings of the demo's API."""
    return ApiSettings(
        host=settings.host, port=settings.port, log_format=settings.log_format,
        admin_token=settings.admin_token, insecure=settings.insecure,
    )  # fmt: skip


def worker_settings_of(settings: DemoSettings, bootstrap: str) -> WorkerSettings:
    """The settings of the demo's worker (Kafka at `bootstrap`): short
    windows on the demo's topic and group, over the shards in this process
    (no URLs); `worker_config` makes its `WorkerConfig`, as for a worker process."""
    return WorkerSettings(
        bootstrap=bootstrap,
        topic=TOPIC,
        group=GROUP,
        window_seconds=settings.window_seconds,
        window_events=WINDOW_EVENTS,
        decode_processes=1,
        session_timeout_ms=6000,
        log_format=settings.log_format,
    )


async def _run(settings: DemoSettings, stop: asyncio.Event, out: TextIO, kafka: KafkaSecurity) -> int:
    api_settings = api_settings_of(settings)
    # Refused before the broker starts: an exposed API needs CTRPS_ADMIN_TOKEN or --insecure.
    api_settings.check_exposed()
    async with contextlib.AsyncExitStack() as stack:
        admin: GeneratedToken | None = None
        if not api_settings.admin_token and not api_settings.insecure:
            # Loopback is every local user's: the admin routes get a token of this run.
            admin = stack.enter_context(generated_admin_token("demo"))
            api_settings = dataclasses.replace(api_settings, admin_token=admin.token)
        # Entered in dependency order, so they close in the reverse: API,
        # client, broker (the worker and producer stop first, below).
        memory: BrokerMemory | None = None
        if settings.bootstrap:
            bootstrap = settings.bootstrap
            await wait_for_metadata(bootstrap, security=kafka)
        else:
            broker = await stack.enter_async_context(EmbeddedBroker())
            bootstrap = broker.bootstrap
            broker_pid = broker.pid
            memory = BrokerMemory(lambda: broker_pid, settings.broker_max_rss_mb * 2**20)
        await create_topics(bootstrap, {TOPIC: PARTITIONS, f"{TOPIC}.dlq": 1}, security=kafka)

        shards = [Shard(ShardSpec(i, settings.shards)) for i in range(settings.shards)]
        exporter: Exporter | None = None
        exports: Path | None = None
        if settings.exports_dir:
            # The broker is new, so an older export's offsets mean nothing
            # here: the demo never restores, and writes into a directory of
            # its own, so no later run (shards restoring the newest export of
            # <exports-dir>/<model>, another demo) resumes from its offsets.
            exports = fresh_exports_dir(Path(settings.exports_dir))
            coordinator = Coordinator(lease_ttl_s=30.0)
            control = await stack.enter_async_context(ControlClient.local(shards, coordinator))
            exporter = Exporter(coordinator, control, exports, api_settings.model_name, file_mode=settings.exports_mode)
            control.serve_exports(exporter)
        else:
            control = await stack.enter_async_context(ControlClient.local(shards))
        client = await stack.enter_async_context(PSClient.local(shards))
        client.slot_source = control.slot_map
        model = make_model(api_settings.model, api_settings.model_name)
        for table in model.tables():
            await control.declare(table)
        server = await stack.enter_async_context(ApiServer(api_settings, client, model, control=control))
        if memory is not None:  # the embedded broker's memory on the API's /metrics, and its limit
            server.app[METRICS].registry.register(memory)
            await stack.enter_async_context(memory.watching())

        worker = _worker(settings, bootstrap, kafka, client, control, model)
        # Event time follows wall time, so windows close on time either way.
        stream = SyntheticStream(seed=settings.seed, events_per_s=settings.rate, start_ts=time.time())
        worker_stop = asyncio.Event()
        working = asyncio.create_task(worker.run(worker_stop), name="worker")
        producing = asyncio.create_task(
            produce(bootstrap, TOPIC, iter(stream), rate=settings.rate, security=kafka), name="producer"
        )
        exporting = (
            asyncio.create_task(exporter.run(settings.export_interval_s, stop), name="exporter")
            if exporter is not None and settings.export_interval_s > 0
            else None
        )
        _announce(
            out, server, bootstrap, settings, exports / api_settings.model_name if exports is not None else None, admin
        )
        failed = await _until_stopped(settings, stop, working, producing)
        if exporting is not None:
            stop.set()
            await exporting

        failed |= await _stop_worker(worker, worker_stop, working, producing)
    return 1 if failed else 0


def _worker(
    settings: DemoSettings, bootstrap: str, kafka: KafkaSecurity, client: PSClient, control: ControlClient, model: Model
) -> Worker:
    """The demo's worker (`worker_settings_of`), its windows reported to the
    status board (the API's /v1/model and /metrics, as for a worker process)
    and by the demo's own progress line."""
    worker = Worker(worker_config(worker_settings_of(settings, bootstrap), kafka), client, control, model)
    worker.on_window = _hooks(
        make_status_hook(control, default_worker_id(), worker.stats, update_mode=worker.config.mode, model=model.name),
        _WindowProgress(control, model),
    )
    return worker


async def _stop_worker(
    worker: Worker, worker_stop: asyncio.Event, working: asyncio.Task[None], producing: asyncio.Task[Any]
) -> bool:
    """Shutdown: no new events; the worker trains and commits what it holds
    and leaves the group (then the caller's stack closes API, client,
    broker). Returns whether the worker failed while stopping."""
    failed = False
    producing.cancel()
    await asyncio.gather(producing, return_exceptions=True)
    worker_stop.set()
    if not working.done():
        try:
            await working
        except Exception as exc:
            failed = True
            log.error("worker failed while stopping", extra={"fields": {"error": repr(exc)}})
    s = worker.stats
    log_event(log, "stopped", windows=s.windows, events=s.events_trained, dead_letters=s.dead_letters)
    return failed


async def _until_stopped(settings: DemoSettings, stop: asyncio.Event, *tasks: asyncio.Task[Any]) -> bool:
    """Wait for `stop` (a signal, or the end of the duration) or for one of
    `tasks` to end, which is a failure: they run until stopped. Returns
    whether one failed."""
    loop = asyncio.get_running_loop()
    timer = loop.call_later(settings.duration_s, stop.set) if settings.duration_s > 0 else None
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({stopping, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if timer is not None:
            timer.cancel()
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
    failed = False
    for task in tasks:
        if task in done:
            failed = True
            log.error(
                f"{task.get_name()} stopped unexpectedly",
                extra={"fields": {"error": repr(task.exception())}},
            )
    return failed
