"""The serve role: the HTTP API alone, reading weights from shard servers,
until signalled."""

from __future__ import annotations

import asyncio

from ps_core.client import PSClient, RetryPolicy
from ps_core.models import make_model

from .api import run_api
from .settings import ApiSettings
from .signals import stop_on_signals

__all__ = ["run_serve"]


async def run_serve(settings: ApiSettings, stop: asyncio.Event | None = None) -> None:
    """Serve the API over the shards at ``settings.shards`` until SIGTERM/SIGINT
    (or `stop`). A shard call is retried for ``settings.shard_deadline_s``,
    then the request gets 503 naming the shard."""
    stop = stop or asyncio.Event()
    model = make_model(settings.model, settings.model_name)
    retry = RetryPolicy(deadline_s=settings.shard_deadline_s)
    with stop_on_signals(stop):
        async with PSClient.connect(settings.shards, retry=retry) as client:
            await run_api(settings, client, model, stop)
