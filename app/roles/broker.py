"""The broker role: the embedded broker with its topics, until signalled."""

from __future__ import annotations

import asyncio
import functools
import logging

from prometheus_client import CollectorRegistry, generate_latest

from consumers.broker import EmbeddedBroker
from consumers.broker_memory import BrokerMemory

from ..config.broker import BrokerSettings
from ..logs import log_event
from ..metrics_site import metrics_site
from ..signals import stop_on_signals

__all__ = ["run_broker"]

log = logging.getLogger("ctrps.broker")


async def run_broker(
    port: int, topics: dict[str, int], stop: asyncio.Event | None = None, settings: BrokerSettings = BrokerSettings()
) -> None:
    """Start the embedded broker, create `topics`, serve until SIGTERM/SIGINT;
    its resident memory is watched against ``settings.max_rss_mb`` (and
    served on ``settings.metrics_port``)."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        async with EmbeddedBroker(port=port, host=settings.host, advertised_host=settings.advertised_host) as broker:
            await broker.create_topics(topics)
            pid = broker.pid
            memory = BrokerMemory(lambda: pid, settings.max_rss_mb * 2**20)
            registry = CollectorRegistry()
            registry.register(memory)
            render = functools.partial(generate_latest, registry)
            async with metrics_site("127.0.0.1", settings.metrics_port, render, "the broker's") as metrics_url:
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
