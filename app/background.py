"""`BackgroundLoop`: one task a component owns, started once and stopped cleanly."""

from __future__ import annotations

import asyncio
from typing import Self

__all__ = ["BackgroundLoop"]


class BackgroundLoop:
    """Owns one background task running `_run`: `start` once, `stop`
    idempotent (cancels and awaits it), ``async with`` support.

    A subclass logs its own failures where they happen, so stopping never
    raises them; `_task` stays set after a failure for the subclass to report.
    """

    task_name = "ctrps-background"
    """The task's name (shown by asyncio's debug tools)."""

    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Start the task (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Stop the task (idempotent); what it built is kept."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
