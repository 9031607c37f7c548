"""The worker role: a training worker against shard servers, until signalled."""

from __future__ import annotations

import asyncio
import functools
import logging

from consumers.kafka_security import KafkaSecurity
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.auth import Scope
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy

from .logs import log_event
from .metrics import worker_exposition
from .metrics_site import metrics_site
from .security import SecuritySettings
from .settings import WorkerSettings
from .signals import stop_on_signals
from .status import default_worker_id, make_status_hook

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
    ``https://`` shards against its CA. Every Kafka client of the worker
    connects as `kafka` says."""
    stop = stop or asyncio.Event()
    security = security or SecuritySettings()
    tls = security.client_tls()
    config = settings.worker_config(kafka)
    how = {"mode": settings.mode, "max_staleness": settings.staleness_bound, "numeric": settings.numeric}
    model = make_model(settings.model, settings.model_name, **how)
    also = [make_model(settings.model, name, **how) for name in settings.also_train]
    worker_id = default_worker_id()
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
    with stop_on_signals(stop):
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
            worker = Worker(config, client, control, model, also=also)
            # Set after construction: the hook reads the worker's own stats.
            fmt = settings.wire().describe()
            worker.on_window = hook = make_status_hook(
                control,
                worker_id,
                worker.stats,
                update_mode=config.mode,
                wire=lambda: {"format": fmt, **client.wire_stats().as_dict()},
                model=settings.model_name,
            )
            hooks = [hook]
            for a in worker.also:
                # Each model's progress is its own entry on the board: the API
                # and /metrics count a model's workers apart.
                a.on_window = also_hook = make_status_hook(
                    control,
                    f"{worker_id}/{a.model.name}",
                    a.stats,
                    update_mode=config.mode,
                    model=a.model.name,
                )
                hooks.append(also_hook)
            render = functools.partial(worker_exposition, hooks)
            async with metrics_site(settings.metrics_host, settings.metrics_port, render, "the worker's") as url:
                if url is not None:
                    log_event(log, "serving metrics", worker=worker_id, url=url)
                await worker.run(stop)
    s = worker.stats
    log_event(
        log, "stopped", windows=s.windows, events=s.events_trained, dead_letters=s.dead_letters, commits=s.commits
    )
