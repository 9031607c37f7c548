"""``GET /metrics`` on a port of its own, for roles that serve no HTTP
otherwise (the broker, a worker): Prometheus text rendered at each scrape.

    async with metrics_site("127.0.0.1", port, render) as url:  # None with port 0
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .failures import ExpectedFailure

__all__ = ["metrics_site"]


@contextlib.asynccontextmanager
async def metrics_site(host: str, port: int, render: Callable[[], bytes], what: str) -> AsyncIterator[str | None]:
    """Serve ``GET /metrics`` (`render()`'s text) on `host`:`port` while the
    block runs, and yield its URL; nothing (None) with port 0. A port that
    cannot be bound is an `ExpectedFailure` naming `what` serves it."""
    if not port:
        yield None
        return

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ExpectedFailure(f"cannot serve {what} metrics on {host}:{port}: {exc.strerror or exc}") from exc
        yield f"http://{host}:{port}/metrics"
    finally:
        await runner.cleanup()
