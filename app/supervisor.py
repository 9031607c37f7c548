"""A process supervisor: child processes started, watched, prefixed and stopped.

`Supervisor` starts each child (`ChildSpec`) in its own process group, copies
its output line by line to one stream with the child's role name on each line
(``[shard-0] ...``; in JSON mode a ``"role"`` key is added to each JSON line),
waits for readiness checks with a deadline, and notices a child that exits on
its own. A child whose spec says ``restart`` is then started again with the
same arguments after a backoff (`RestartPolicy`: doubling delays, reset once
a run lasted long enough), one log line per restart; a child that keeps
failing (too many restarts within a window), or one that may not restart, is
a failure. `Supervisor.stop` stops the children in the reverse of their start
order, one stop group at a time (e.g. every worker at once): SIGTERM, then
SIGKILL of the child's whole process group after a grace period; a child
waiting to be restarted is not started again.

Own process groups: Ctrl-C in a terminal then reaches only the supervisor, which
decides the order (workers must flush their last window while the shards are
still up); the SIGKILL fallback reaches the child's own helpers too (a worker's
decode processes).

Children end with the supervisor, even a SIGKILLed one that can stop nothing:
each is started with Linux's parent-death signal (SIGKILL,
`consumers.lifetime.ending_with_parent`), set between fork and exec, so no
role is left running, and holding its port, with its output going nowhere.
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

from consumers.lifetime import ending_with_parent
from ps_core.waits import within

from .logs import log_event

__all__ = ["ChildSpec", "Child", "ChildFailed", "RestartPolicy", "Supervisor", "LinePrefixer", "describe_exit"]

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
    restart: bool = False
    """Start it again (same arguments, after a backoff) when it exits on its
    own, instead of failing; see `RestartPolicy`."""
    restart_argv: Callable[[], tuple[str, ...]] | None = None
    """The arguments of a restart, asked for at each restart; None: `argv`."""
    before_restart: Callable[[], Awaitable[object]] | None = None
    """Awaited after the backoff, before the process is started again (e.g.
    to end a helper of the last run that left its process group)."""

    @property
    def stop_group(self) -> str:
        """The group it is stopped with."""
        return self.group or self.role


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a child with ``restart`` is started again.

    The n-th restart in a row waits ``min(max_backoff_s, backoff_s * 2**(n-1))``;
    a run that lasted `healthy_s` or longer starts the count again. A child
    that would be restarted more than `max_restarts` times within `window_s`
    keeps failing: that is a failure of the child (0: never restarted)."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 300.0

    def delay(self, attempt: int) -> float:
        """Seconds before restart number `attempt` (1, 2, ...) in a row."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt - 1, 60)))


def describe_exit(rc: int) -> str:
    """``exited with 3`` or ``killed by SIGKILL``."""
    if rc >= 0:
        return f"exited with {rc}"
    try:
        return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"killed by signal {-rc}"


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
    """Set while its current process has exited (cleared when it is restarted)."""
    restarts: int = 0
    """Times it was started again."""
    attempt: int = 0
    """Restarts in a row since its last healthy run."""
    started_at: float = 0.0
    """Loop time its current process started."""
    restart_times: list[float] = field(default_factory=list)
    """Loop times of its restarts within the policy's window."""
    waiting_restart: bool = False
    """Between an exit and the next process: its backoff."""
    stopped_while_down: bool = False
    """Stopped while waiting to be restarted: its last exit was handled."""
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    spawning: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while a restart checks `stopping` and starts the process."""

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
        return orjson.dumps({"role": self.role, "msg": "output", "line": line.decode("utf-8", "replace")})


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
        restart: RestartPolicy | None = None,
    ) -> None:
        self.out = out if out is not None else sys.stdout.buffer
        self.fmt = fmt
        self.grace_s = grace_s
        self.restart = restart or RestartPolicy()
        self.restarts = 0
        """Restarts of every child so far (the counter in each ``restarting`` line)."""
        self.children: list[Child] = []
        self.failed: Child | None = None
        self._failure = asyncio.Event()
        self._stopped = False

    async def start(self, spec: ChildSpec) -> Child:
        """Start `spec` in its own process group, its output prefixed."""
        if self._stopped:
            raise RuntimeError("the supervisor has stopped")
        creating = asyncio.ensure_future(self._spawn(spec, spec.argv))
        try:
            process = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # Cancelled while the process was being created: it may exist
            # already, so it is registered (and `stop_all` stops it).
            with contextlib.suppress(Exception):
                self._register(spec, await creating)
            raise
        return self._register(spec, process)

    @staticmethod
    async def _spawn(spec: ChildSpec, argv: Sequence[str]) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(spec.env) if spec.env is not None else None,
            start_new_session=True,
            # SIGKILL, not SIGTERM: with the supervisor gone nobody orders the
            # stop, and a worker flushing to stopping shards could wait minutes.
            preexec_fn=ending_with_parent(),
        )

    def _register(self, spec: ChildSpec, process: asyncio.subprocess.Process) -> Child:
        child = Child(spec, process, started_at=asyncio.get_running_loop().time())
        self.children.append(child)
        child.pump = asyncio.create_task(self._pump(child), name=f"pump-{spec.role}")
        child.watcher = asyncio.create_task(self._watch(child), name=f"watch-{spec.role}")
        log_event(log, "started", role=spec.role, pid=process.pid)
        return child

    async def _pump(self, child: Child) -> None:
        prefixer = LinePrefixer(child.role, self.out, self.fmt)
        stream = child.process.stdout  # this run's: a restart has a pump of its own
        assert stream is not None
        try:
            # Raw chunks, not readline: a line of any length is copied whole.
            while chunk := await stream.read(_READ_CHUNK):
                prefixer.feed(chunk)
        finally:
            prefixer.close()

    async def _watch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        while True:
            rc = await child.process.wait()
            child.exited.set()
            if child.stopping:
                return
            if rc == 0 and child.spec.may_finish:
                log_event(log, "finished", role=child.role, pid=child.pid)
                return
            # Its helpers (a worker's decode processes) go with it, before any restart.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            reason = describe_exit(rc)
            if not child.spec.restart or self._stopped:
                # Not restarted while everything stops: that exit is a failure, as before.
                self._fail(child, reason, "child exited unexpectedly", rc)
                return
            if not await self._restart(child, rc, reason, loop):
                return

    def _fail(self, child: Child, reason: str, message: str, rc: int, **fields: object) -> None:
        child.failure = reason
        log.error(
            message,
            extra={"fields": {"role": child.role, "pid": child.pid, "returncode": rc, **fields}},
        )
        if self.failed is None:
            self.failed = child
        self._failure.set()

    async def _restart(self, child: Child, rc: int, reason: str, loop: asyncio.AbstractEventLoop) -> bool:
        """Wait the backoff and start `child` again; False when it is not
        restarted (it keeps failing, or it was stopped meanwhile)."""
        policy = self.restart
        now = loop.time()
        if now - child.started_at >= policy.healthy_s:
            child.attempt = 0
        child.restart_times = [t for t in child.restart_times if now - t < policy.window_s]
        if len(child.restart_times) >= policy.max_restarts:
            self._fail(
                child,
                f"{reason}; restarted {len(child.restart_times)} times within {policy.window_s:g}s",
                "child keeps failing: stopping",
                rc,
                restarts=child.restarts,
                max_restarts=policy.max_restarts,
                window_s=policy.window_s,
            )
            return False
        child.attempt += 1
        child.restarts += 1
        self.restarts += 1
        child.restart_times.append(now)
        delay = policy.delay(child.attempt)
        log.warning(
            "restarting a child",
            extra={"fields": {"role": child.role, "pid": child.pid, "reason": reason,
                              "returncode": rc, "attempt": child.attempt, "delay_s": delay,
                              "restarts": self.restarts}},
        )  # fmt: skip
        child.waiting_restart = True
        with contextlib.suppress(asyncio.TimeoutError):
            await within(child.stop_requested.wait(), delay)
        if child.spec.before_restart is not None and not child.stopping:
            try:
                await child.spec.before_restart()
            except Exception as exc:  # e.g. a leftover process that would not die
                log.warning("before restart", extra={"fields": {"role": child.role, "error": repr(exc)}})
        async with child.spawning:
            # `_stop` takes the lock after setting `stopping`: either it sees
            # the new process, or no new process is started.
            if child.stopping or self._stopped:
                return False
            if child.pump is not None:
                # The last run's output is copied whole before the new run's.
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(asyncio.shield(child.pump), 5.0)
            argv = child.spec.restart_argv() if child.spec.restart_argv else child.spec.argv
            try:
                process = await self._spawn(child.spec, argv)
            except OSError as exc:  # the program vanished, too many processes, ...
                child.waiting_restart = False
                self._fail(child, f"{reason}; restart failed: {exc}", "child could not be restarted", rc)
                return False
            child.waiting_restart = False
            child.process = process
            child.started_at = loop.time()
            child.exited.clear()
            child.pump = asyncio.create_task(self._pump(child), name=f"pump-{child.role}")
        log_event(log, "started", role=child.role, pid=process.pid, attempt=child.attempt)
        return True

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
                if await within(check(), left):
                    log_event(log, "ready", role=child.role, pid=child.pid)
                    return
            except Exception as exc:  # not listening yet, a refused request, ...
                log.debug("not ready", extra={"fields": {"role": child.role, "error": repr(exc)}})
            if loop.time() >= deadline:
                raise ChildFailed(child.role, f"not ready within {timeout_s:.0f}s")
            # The child's exit wakes this at once; otherwise poll again after the interval.
            with contextlib.suppress(asyncio.TimeoutError):
                await within(child.exited.wait(), interval_s)

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
        return [
            c for c in self.children if c.failure is None and not c.stopped_while_down and c.returncode not in clean
        ]

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
        child.stop_requested.set()  # a child waiting to be restarted stays down
        async with child.spawning:  # a restart under way finishes first
            pass
        if child.waiting_restart and child.failure is None:
            # It had exited on its own and was waiting for its restart: handled.
            child.stopped_while_down = True
        if not child.exited.is_set():
            log_event(log, "stopping", role=child.role, pid=child.pid)
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
            try:
                await within(child.exited.wait(), self.grace_s)
            except TimeoutError:
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
                await within(child.pump, 5.0)
            except TimeoutError:
                pass
        if child.stopped_while_down:
            log_event(log, "stopped", role=child.role, pid=child.pid, returncode=child.returncode,
                      restarts=child.restarts, waiting_to_restart=True)  # fmt: skip
        elif child.returncode is not None and child.failure is None:
            log_event(log, "stopped", role=child.role, pid=child.pid, returncode=child.returncode,
                      restarts=child.restarts)  # fmt: skip
