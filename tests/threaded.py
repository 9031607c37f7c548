"""A server on 127.0.0.1 run by an event loop in a thread of its own, for
tests that call it synchronously (schemathesis's pytest integration makes
blocking `requests` calls from the test's thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

__all__ = ["serve_in_thread"]

# Starts the server(s) and returns (base URL, a coroutine function stopping them).
Start = Callable[[], Awaitable[tuple[str, Callable[[], Awaitable[None]]]]]


@contextmanager
def serve_in_thread(start: Start, timeout_s: float = 20.0) -> Iterator[str]:
    """Run `start` in a new event loop in a daemon thread; yields the URL it
    returned, and stops the servers and the loop on exit (bounded in time)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        stopped = asyncio.Event()
        box["stop"] = stopped
        try:
            url, stop = await start()
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            return
        box["url"] = url
        ready.set()
        try:
            await stopped.wait()
        finally:
            await stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True, name="served")
    thread.start()
    try:
        if not ready.wait(timeout_s):
            raise AssertionError(f"the server did not start within {timeout_s} s")
        if "error" in box:
            raise AssertionError("the server did not start") from box["error"]  # type: ignore[misc]
        yield str(box["url"])
    finally:
        stop_event = box.get("stop")
        if isinstance(stop_event, asyncio.Event):
            loop.call_soon_threadsafe(stop_event.set)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
