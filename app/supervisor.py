"""A process supervisor: child processes started, watched, prefixed and stopped.

`Supervisor` starts each child (`ChildSpec`) in its own process group, copies
its output line by line to one stream with the child's role name on each line
(``[shard-0] ...``; in JSON mode a ``"role"`` key is added to each JSON line),
waits for readiness checks with a deadline, and notices a child that exits on
its own. `Supervisor.stop` stops the children in the reverse of their start
order, one stop group at a time (e.g. every worker at once): SIGTERM, then
SIGKILL of the child's whole process group after a grace period.

Own process groups: Ctrl-C in a terminal then reaches only the supervisor, which
decides the order (workers must flush their last window while the shards are
still up); the SIGKILL fallback reaches the child's own helpers too (a worker's
decode processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import orjson

from .logs import log_event

__all__ = ["ChildSpec", "Child", "ChildFailed", "Supervisor", "LinePrefixer"]

log = logging.getLogger("ctrps.supervisor")

_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ChildSpec:
    """How to run one child process."""

    role: str
    """Its name on every output line and in the supervisor's log (``shard-0``)."""
    argv: tuple[str, ...]
    """Program and arguments."""
    group: str = ""
    """Children of one stop group are stopped together; default: the role."""
    may_finish: bool = False
    """Exit status 0 is normal completion (a producer with a finite stream),
    not a failure. Any other exit of any child is a failure."""
    env: Mapping[str, str] | None = None
    """The child's environment; None inherits the supervisor's."""

    @property
    def stop_group(self) -> str:
        """The group it is stopped with."""
        return self.group or self.role


class ChildFailed(RuntimeError):
    """A child exited when it should not have, or never became ready."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(f"{role}: {message}")
        self.role = role


@dataclass
class Child:
    """A running (or finished) child."""

    spec: ChildSpec
    process: asyncio.subprocess.Process
    pump: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    stopping: bool = False
    """Set once the supervisor asked it to stop: its exit is then expected."""
    failure: str | None = None
    """Why its exit was a failure, when it was."""
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


class LinePrefixer:
    """Splits a child's output into lines and writes each with its role.

    ``text``: ``[role] line``. ``json``: a line holding a JSON object gets a
    ``"role"`` key (the line stays one JSON object); any other line is wrapped
    as ``{"role": ..., "msg": "output", "line": ...}``.
    """

    def __init__(self, role: str, out: BinaryIO, fmt: str = "text") -> None:
        self.role = role
        self.out = out
        self.fmt = fmt
        self._partial = b""
        self._prefix = f"[{role}] ".encode()

    def feed(self, data: bytes) -> None:
        """Write every complete line of `data` (plus what was buffered)."""
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        self._write(lines)

    def close(self) -> None:
        """Write a last line that had no newline."""
        if self._partial:
            self._write([self._partial])
            self._partial = b""

    def _write(self, lines: Sequence[bytes]) -> None:
        if not lines:
            return
        self.out.write(b"".join(self._format(line.rstrip(b"\r")) + b"\n" for line in lines))
        self.out.flush()

    def _format(self, line: bytes) -> bytes:
        if self.fmt != "json":
            return self._prefix + line
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return orjson.dumps({"role": self.role, **obj})
        return orjson.dumps(
            {"role": self.role, "msg": "output", "line": line.decode("utf-8", "replace")}
        )


class Supervisor:
    """Starts children, watches them, and stops them in reverse start order.

    ``await start(spec)`` then ``await wait_ready(child, check, timeout_s)``;
    ``await wait()`` returns when `stop` is set or a child fails; ``await
    stop_all()`` stops everything (idempotent). `failed` names the first child
    whose exit was a failure.
    """

    def __init__(
        self,
        *,
        out: BinaryIO | None = None,
        fmt: str = "text",
        grace_s: float = 10.0,
    ) -> None:
        self.out = out if out is not None else sys.stdout.buffer
        self.fmt = fmt
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.failed: Child | None = None
        self._failure = asyncio.Event()
        self._stopped = False

    async def start(self, spec: ChildSpec) -> Child:
        """Start `spec` in its own process group, its output prefixed."""
        if self._stopped:
            raise RuntimeError("the supervisor has stopped")
        creating = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=dict(spec.env) if spec.env is not None else None,
                start_new_session=True,
            )
        )
        try:
            process = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # Cancelled while the process was being created: it may exist
            # already, so it is registered (and `stop_all` stops it).
            with contextlib.suppress(Exception):
                self._register(spec, await creating)
            raise
        return self._register(spec, process)

    def _register(self, spec: ChildSpec, process: asyncio.subprocess.Process) -> Child:
        child = Child(spec, process)
        self.children.append(child)
        child.pump = asyncio.create_task(self._pump(child), name=f"pump-{spec.role}")
        child.watcher = asyncio.create_task(self._watch(child), name=f"watch-{spec.role}")
        log_event(log, "started", role=spec.role, pid=process.pid)
        return child

    async def _pump(self, child: Child) -> None:
        prefixer = LinePrefixer(child.role, self.out, self.fmt)
        stream = child.process.stdout
        assert stream is not None
        try:
            # Raw chunks, not readline: a line of any length is copied whole.
            while chunk := await stream.read(_READ_CHUNK):
                prefixer.feed(chunk)
        finally:
            prefixer.close()

    async def _watch(self, child: Child) -> None:
        rc = await child.process.wait()
        child.exited.set()
        if child.stopping:
            return
        if rc == 0 and child.spec.may_finish:
            log_event(log, "finished", role=child.role, pid=child.pid)
            return
        child.failure = f"exited with {rc}" if rc >= 0 else f"killed by {signal.Signals(-rc).name}"
        log.error(
            "child exited unexpectedly",
            extra={"fields": {"role": child.role, "pid": child.pid, "returncode": rc}},
        )
        if self.failed is None:
            self.failed = child
        self._failure.set()

    async def wait_ready(
        self,
        child: Child,
        check: Callable[[], Awaitable[bool]],
        timeout_s: float,
        interval_s: float = 0.1,
    ) -> None:
        """Poll `check` until it returns True; raise `ChildFailed` if `child`
        exits first or `timeout_s` passes. `check` may raise: that counts as
        not ready yet (the child may not be listening)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if child.exited.is_set():
                raise ChildFailed(child.role, f"exited with {child.returncode} before it was ready")
            try:
                left = max(0.05, deadline - loop.time())
                if await asyncio.wait_for(check(), timeout=left):
                    log_event(log, "ready", role=child.role, pid=child.pid)
                    return
            except Exception as exc:  # not listening yet, a refused request, ...
                log.debug("not ready", extra={"fields": {"role": child.role, "error": repr(exc)}})
            if loop.time() >= deadline:
                raise ChildFailed(child.role, f"not ready within {timeout_s:.0f}s")
            # The child's exit wakes this at once; otherwise poll again after the interval.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.exited.wait(), timeout=interval_s)

    async def wait(self, stop: asyncio.Event) -> None:
        """Return when `stop` is set or a child fails (then `failed` is set)."""
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._failure.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    @property
    def unclean(self) -> list[Child]:
        """Children that did not stop cleanly when asked: killed after the
        grace period, or an error status. Exiting 0, or by the SIGTERM itself
        (a child stopped while still starting, before its handler was in
        place), is clean."""
        clean = (None, 0, -signal.SIGTERM)
        return [c for c in self.children if c.failure is None and c.returncode not in clean]

    def exit_status(self) -> int:
        """0 when no child failed and every child stopped cleanly, else 1."""
        return 1 if self.failed is not None or self.unclean else 0

    async def stop_all(self) -> None:
        """Stop every child, the last started first, one stop group at a time."""
        self._stopped = True
        groups: list[list[Child]] = []
        for child in reversed(self.children):
            if groups and groups[-1][0].spec.stop_group == child.spec.stop_group:
                groups[-1].append(child)
            else:
                groups.append([child])
        for group in groups:
            await asyncio.gather(*(self._stop(c) for c in group))

    async def _stop(self, child: Child) -> None:
        child.stopping = True
        if not child.exited.is_set():
            log_event(log, "stopping", role=child.role, pid=child.pid)
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.exited.wait(), self.grace_s)
            except asyncio.TimeoutError:
                log.warning(
                    "killing a child that ignored SIGTERM",
                    extra={"fields": {"role": child.role, "pid": child.pid, "grace_s": self.grace_s}},
                )
        # The whole process group: a helper the child started (a worker's decode
        # processes) must not outlive it, whether it stopped cleanly or not.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        await child.exited.wait()
        if child.watcher is not None:
            await child.watcher
        if child.pump is not None:
            # A grandchild that kept the pipe open is gone with its group; the
            # rest of the output is copied, within a bound.
            try:
                await asyncio.wait_for(child.pump, 5.0)
            except asyncio.TimeoutError:
                pass
        if child.returncode is not None and child.failure is None:
            log_event(log, "stopped", role=child.role, pid=child.pid, returncode=child.returncode)
