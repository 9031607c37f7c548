"""Bounded waits that keep a cancellation.

On Python 3.11, ``asyncio.wait_for`` loses a cancellation that arrives as
its awaitable completes: it returns the result, and a loop around it never
sees the cancel (a watch that runs until cancelled then runs for ever, and
whoever awaits it waits with it). ``asyncio.timeout`` cancels the waiting
task itself, so a cancel from outside is still delivered at the next await.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["cancelled", "within"]

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`aw`'s result, or `TimeoutError` once `timeout_s` has passed (`aw`
    cancelled); None waits without a bound. A drop-in for
    ``asyncio.wait_for`` that never swallows the caller's cancellation."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has finished. Its own cancellation is
    not raised (its other failure is); the caller's is, which awaiting the
    task under ``suppress(CancelledError)`` would swallow when the caller is
    cancelled during the wait."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
