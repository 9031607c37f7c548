"""Child processes in tests: ``ctrps`` run as a user would (started in the
project's root, without the test run's own CTRPS_ settings), a command's
``--help`` checked, whether a process has ended, and a process's descendants."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from consumers.broker import PORT_BAND_VAR

__all__ = ["PROJECT", "assert_help_shows", "clean_env", "ctrps", "ctrps_process", "descendants", "pid_gone"]

PROJECT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without CTRPS_* variables, plus `extra` (and
    PYTHONUNBUFFERED: a child's lines reach its files as it writes them).
    The test process's own port band stays (`PORT_BAND_VAR`, set per xdist
    process): a child picks its ports in it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_") or k == PORT_BAND_VAR}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


def ctrps(*args: str) -> subprocess.CompletedProcess[str]:
    """``ctrps ARGS`` run to its end (30 s at most) in `clean_env`, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def as_a_user(cwd: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` as a user's project runs it: in `cwd`, this project on
    the path as an installed package would be, nothing else of this
    environment; its output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={"PYTHONPATH": str(PROJECT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def assert_help_shows(command: str, example: str, flags: Iterable[str]) -> None:
    """``ctrps COMMAND --help`` exits 0 and shows its usage, an ``examples:``
    section with `example`, and every one of `flags`."""
    out = ctrps(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: ctrps {command}" in out.stdout and "examples:" in out.stdout, out.stdout
    assert example in out.stdout, (example, out.stdout)
    for flag in flags:
        assert flag in out.stdout, (flag, out.stdout)


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


def descendants(pid: int) -> set[int]:
    """Every running process below `pid`: children, grandchildren, ... (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
