"""Waiting in tests: for a condition, with a deadline, never for a fixed time."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

__all__ = ["json_when_ok", "until"]


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 10.0,
    *,
    what: str = "the condition",
    task: asyncio.Task[Any] | None = None,
    poll_s: float = 0.02,
) -> None:
    """Return once `condition()` (a bool, or an awaitable of one) holds,
    checking every `poll_s`. Raises AssertionError naming `what` when
    `timeout_s` passes first; with `task`, also when that task ends first
    (raising its own exception if it failed). A condition may itself raise to
    fail at once (e.g. a child process that exited)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = condition()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if task is not None and task.done():
            task.result()
            raise AssertionError(f"{task.get_name()} ended before {what}")
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)  # poll interval


async def json_when_ok(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    """The JSON body of GET `url` if it answers 200 within a second; None if
    it does not answer (yet) or answers another status: one poll of a
    server that is starting."""
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
            if resp.status == 200:
                return orjson.loads(await resp.read())
    except (TimeoutError, aiohttp.ClientError):
        pass  # not listening yet
    return None
