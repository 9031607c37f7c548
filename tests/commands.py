"""Running ``ctrps`` from tests as a user would: a child process started in
the project's root, without the test run's own CTRPS_ settings."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

__all__ = ["PROJECT", "ctrps_process"]

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
