"""Commits a worker stopped waiting for that fail later: one line, not a traceback.

aiokafka sends a commit inside ``asyncio.shield``. When a worker gives up on
a commit (`consumers.pipeline.Pipeline.commit`, bounded by its commit
timeout) the request goes on in aiokafka's own task until the client's
request timeout. If it then fails, nobody reads its error, and asyncio logs
"Task exception was never retrieved" with a traceback, as if something had
crashed. It has not: the window was already counted as failed and is
trained again from its first offsets. While a worker runs,
`late_commits_reported` turns that case into one warning line and a count
(`WorkerStats.late_commit_failures`); any other unhandled error still goes
to the handler it would have gone to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from .reports import WorkerStats

__all__ = ["COMMIT_TASK", "late_commits_reported"]

log = logging.getLogger("ctrps.worker")

COMMIT_TASK = "_do_commit_offsets"
"""The name of the coroutine aiokafka's group coordinator shields a commit in."""


def _is_late_commit(context: dict[str, Any]) -> bool:
    task, exc = context.get("future"), context.get("exception")
    if not isinstance(task, asyncio.Task) or not isinstance(exc, Exception):
        return False
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and code.co_name == COMMIT_TASK and "aiokafka" in code.co_filename


@contextlib.contextmanager
def late_commits_reported(stats: WorkerStats) -> Iterator[None]:
    """Inside the block, a commit given up on that fails later is logged in
    one line and counted in `stats`; every other error the event loop is
    told of goes to the handler set before (or asyncio's default)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _is_late_commit(context):
            stats.late_commit_failures += 1
            exc = context["exception"]
            log.warning(
                "a commit given up on failed later: its window was already trained again",
                extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}},
            )
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        if loop.get_exception_handler() is handler:  # not replaced meanwhile by another worker's
            loop.set_exception_handler(previous)
