"""Child processes in tests: ``ctrps`` run as a user would (started in the
project's root, without the test run's own CTRPS_ settings), and whether a
process has ended."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

__all__ = ["PROJECT", "ctrps_process", "pid_gone"]

PROJECT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def ctrps_process(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``ctrps ARGS`` with its stderr piped while the block runs; killed at
    the end if it still runs (a test that failed before it stopped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *args, cwd=PROJECT, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def pid_gone(pid: int) -> bool:
    """The process no longer runs (or is a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"
