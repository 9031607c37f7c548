"""The worker role: a training worker against shard servers, until signalled."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

from consumers.kafka_security import KafkaSecurity
from consumers.outage import OutageWatch, StartupWatch, began, describe, is_outage
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import NoCoordinatorError, PSError, UnknownModelError
from ps_core.model.models import make_model
from ps_core.net.auth import Scope
from ps_core.net.client import PSClient
from ps_core.net.control_messages import ModelEntry
from ps_core.net.endpoint import RetryPolicy

from ..config.worker import WorkerSettings, worker_config
from ..logs import log_event
from ..metrics import worker_exposition
from ..metrics_site import metrics_site
from ..security import SecuritySettings
from ..signals import stop_on_signals
from ..startup import await_broker, check_shards, unless_stopped
from ..status import StatusHook, default_worker_id, make_status_hook

__all__ = ["run_worker"]

log = logging.getLogger("ctrps.worker")


async def run_worker(
    settings: WorkerSettings,
    stop: asyncio.Event | None = None,
    *,
    security: SecuritySettings | None = None,
    kafka: KafkaSecurity = KafkaSecurity(),
) -> None:
    """Train from Kafka until SIGTERM/SIGINT (or `stop`): then finish the
    buffered window, commit it, and leave the group.

    After each window the worker's status goes to the shards' status board
    (`app.status`), where the API reads it for ``/v1/model`` and ``/metrics``.
    It presents `security`'s token of the train scope, and verifies
    ``https://`` shards against its CA. Each shard (in its place) and the
    broker must answer within ``settings.startup_timeout_s`` of the start
    (`app.startup`); then their outages are waited out. Every Kafka client of the worker
    connects as `kafka` says."""
    stop = stop or asyncio.Event()
    security = security or SecuritySettings()
    worker_id = default_worker_id()
    # The metrics port first: a taken port is found before any wait. Its
    # families fill in once the hooks exist (below).
    hooks: list[StatusHook] = []
    render = functools.partial(worker_exposition, hooks)
    async with metrics_site(settings.metrics_host, settings.metrics_port, render, "the worker's") as metrics_url:
        await _run_worker(settings, kafka, stop, security, worker_id, hooks, metrics_url)


async def _run_worker(
    settings: WorkerSettings,
    kafka: KafkaSecurity,
    stop: asyncio.Event,
    security: SecuritySettings,
    worker_id: str,
    hooks: list[StatusHook],
    metrics_url: str | None,
) -> None:
    tls = security.client_tls()
    with stop_on_signals(stop):
        # Addresses that never answered are wrong ones: waited for under the
        # start-up deadline, not the outage deadline.
        watch = StartupWatch(settings.startup_timeout_s, "--startup-timeout", log)

        async def first_answers() -> None:
            await check_shards(settings.shards, watch, ssl=tls)
            await await_broker(settings.bootstrap, kafka, watch)

        if not await unless_stopped(stop, first_answers):
            log_event(log, "stopped before start")
            return
        token = security.token_for(Scope.TRAIN)
        async with (
            PSClient.connect(
                settings.shards, rpc=settings.use_rpc, token=token, ssl=tls, wire=settings.wire()
            ) as client,
            # A sync step's arrival waits up to the deadline: give each call longer.
            ControlClient.connect(
                settings.shards,
                token=token,
                ssl=tls,
                retry=RetryPolicy(deadline_s=max(10.0, settings.sync_deadline_s + 5)),
            ) as control,
        ):
            client.slot_source = control.slot_map  # where keys go after a shard answers `moved`
            declared = await _as_declared(settings, control, stop)
            if declared is None:
                log.info("stop asked while waiting for shard 0: nothing trained")
                return
            settings = declared
            config = worker_config(settings, kafka)
            how = {"mode": settings.mode, "max_staleness": settings.staleness_bound, "numeric": settings.numeric}
            model = make_model(settings.model, settings.model_name, **how)
            also = [make_model(settings.model, name, **how) for name in settings.also_train]
            log_event(
                log,
                "starting",
                worker=worker_id,
                topic=settings.topic,
                group=settings.group,
                shards=len(settings.shards),
                model=settings.model,
                name=settings.model_name,
                also_train=",".join(settings.also_train) or "-",
                mode=settings.mode,
                wire=settings.wire().describe(),
                on_stale_offsets=settings.on_stale_offsets,
                **kafka.fields(),
            )
            worker = Worker(config, client, control, model, also=also)
            hooks.extend(_status_hooks(worker, settings, control, client, worker_id))
            if metrics_url is not None:
                log_event(log, "serving metrics", worker=worker_id, url=metrics_url)
            await worker.run(stop)
    s = worker.stats
    log_event(
        log, "stopped", windows=s.windows, events=s.events_trained, dead_letters=s.dead_letters, commits=s.commits
    )


def _status_hooks(
    worker: Worker, settings: WorkerSettings, control: ControlClient, client: PSClient, worker_id: str
) -> list[StatusHook]:
    """Report each window to the status board (`app.status`): the worker's,
    and each model it also trains as an entry of its own (the API and
    /metrics count a model's workers apart). Set after construction: the
    hooks read the worker's own stats."""
    fmt = settings.wire().describe()
    worker.on_window = hook = make_status_hook(
        control,
        worker_id,
        worker.stats,
        update_mode=worker.config.mode,
        wire=lambda: {"format": fmt, **client.wire_stats().as_dict()},
        model=settings.model_name,
    )
    hooks = [hook]
    for a in worker.also:
        a.on_window = also_hook = make_status_hook(
            control, f"{worker_id}/{a.model.name}", a.stats, update_mode=worker.config.mode, model=a.model.name
        )
        hooks.append(also_hook)
    return hooks


async def _as_declared(settings: WorkerSettings, control: ControlClient, stop: asyncio.Event) -> WorkerSettings | None:
    """`settings` with the type and update mode of the model it names as the
    cluster declared it (``ctrps model create``, or its first worker), for
    those of the two no flag or variable gave (`WorkerSettings.inherit`).
    One given that differs is left as given: the worker refuses it in one
    line. A cluster without the model (or without a model registry) keeps the
    flags' defaults. A shard 0 that does not answer is waited for as any
    outage is (`OutageWatch`: a line every few seconds, `OutageDeadlineError`
    past ``--outage-deadline``); None when `stop` is set meanwhile."""
    if not settings.inherit:
        return settings
    found: list[ModelEntry | None] = []

    async def read() -> None:
        try:
            found.append(await control.model_info(settings.model_name))
        except (UnknownModelError, NoCoordinatorError):
            found.append(None)

    since = time.monotonic()
    try:
        await read()
    except PSError as exc:
        if not is_outage(exc):
            raise
        watch = OutageWatch(settings.outage_deadline_s)
        waiting = asyncio.create_task(watch.wait(describe(exc, settings.bootstrap), read, began(exc, since)))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, stopping):
                task.cancel()
            await asyncio.gather(waiting, stopping, return_exceptions=True)
        if waiting.cancelled():
            return None  # stopped first
        waiting.result()  # OutageDeadlineError past the deadline
    info = found[-1]
    if info is None or info.type is None:
        return settings
    spec = ModelSpec.from_entry(info)
    kind = spec.kind if "model" in settings.inherit else settings.model
    mode = spec.mode if "mode" in settings.inherit else settings.mode
    taken = [k for k, v in (("model", kind), ("mode", mode)) if getattr(settings, k) != v]
    if not taken:
        return settings
    settings = dataclasses.replace(settings, model=kind, mode=mode)
    log_event(
        log,
        "model type and mode taken from its declaration",
        model=settings.model_name,
        type=settings.model,
        mode=settings.mode,
        taken=",".join(taken),
    )
    return settings
