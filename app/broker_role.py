"""The broker role: the embedded broker with its topics, until signalled."""

from __future__ import annotations

import asyncio
import logging

from consumers.broker import EmbeddedBroker

from .logs import log_event
from .signals import stop_on_signals

__all__ = ["run_broker"]

log = logging.getLogger("ctrps.broker")


async def run_broker(port: int, topics: dict[str, int], stop: asyncio.Event | None = None) -> None:
    """Start the embedded broker, create `topics`, serve until SIGTERM/SIGINT."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        async with EmbeddedBroker(port=port) as broker:
            await broker.create_topics(topics)
            log_event(
                log,
                "ready",
                bootstrap=broker.bootstrap,
                pid=broker.pid,
                # New at every start: its memory, and so its offsets, are new too.
                cluster_id=broker.cluster_id,
                topics=",".join(f"{k}:{v}" for k, v in topics.items()),
            )
            await stop.wait()
    log_event(log, "stopped")
