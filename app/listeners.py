"""Which process listens on a TCP port, read from Linux's ``/proc``.

`ctrps cluster` checks with it that what answers a role's readiness probe is
the process it started (not one left over from another run, holding the
port), and names the other process when a port is taken. Elsewhere than
Linux, or for another user's processes, the answer is "not known" (None, or
fewer pids), never a guess.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["listener_pids", "is_descendant", "describe_process", "port_taken_by"]

_LISTEN = "0A"  # the state column of /proc/net/tcp: TCP_LISTEN


def _listening_inodes(port: int) -> set[int] | None:
    """Inodes of the sockets listening on `port` (any address); None without ``/proc/net``."""
    inodes: set[int] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(cols[9]))
    return inodes if found else None


def listener_pids(port: int) -> list[int] | None:
    """Pids of the processes (of those this user may inspect) holding a
    socket that listens on `port`; None where ``/proc`` does not tell."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    pids = []
    if wanted:
        with os.scandir("/proc") as procs:
            for entry in procs:
                if entry.name.isdigit() and _holds(entry.name, wanted):
                    pids.append(int(entry.name))
    return sorted(pids)


def _holds(pid: str, sockets: set[str]) -> bool:
    """Whether process `pid` has one of `sockets` open (False when it cannot be read)."""
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd.path) in sockets:
                    return True
    return False


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or one of its children, grandchildren, ..."""
    seen = 0
    while pid > 1 and seen < 64:  # a bound: a chain of reparentings cannot loop forever
        if pid == ancestor:
            return True
        pid, seen = _parent(pid), seen + 1
    return False


def describe_process(pid: int) -> str:
    """``pid 1234 (python -m app.cli serve --port 8080)``; the command line
    is cut at 120 characters, left out when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return f"pid {pid}"
    cmd = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
    if len(cmd) > 120:
        cmd = cmd[:117] + "..."
    return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"


def port_taken_by(port: int, host: str = "127.0.0.1") -> str:
    """Who holds `port`, for an error line: ``taken by pid 1234 (...)``, or
    by a process this user cannot see."""
    pids = listener_pids(port)
    if pids:
        return f"port {port} on {host} is taken by " + ", ".join(describe_process(p) for p in pids)
    return f"port {port} on {host} is taken by another process (of another user, or not shown by this system)"
