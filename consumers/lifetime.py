"""Child processes that end with their parent, however the parent ends.

On Linux the kernel sends a process a signal of its choice when its parent
dies (``prctl(PR_SET_PDEATHSIG)``), even a SIGKILLed parent that could run no
clean-up of its own. `die_with_parent` asks for it from inside the child (a
worker's decode processes, at the top of their initializer);
`ending_with_parent` gives a ``preexec_fn`` that asks for it in a child
between fork and exec, so it covers programs that are not ours (the broker
binary) and the interpreter start-up of those that are (``ctrps`` roles).

The death signal is tied to the *thread* that forked the child: a child
started from a thread that then ends is signalled when that thread ends.
Children here are started from the event loop's thread, which lives as long
as the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "ending_with_parent"]

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl: Callable[..., int] = libc.prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Resolved once, in the parent: the forked child only calls it (no loading,
# no lookup between fork and exec).
_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; whether it took."""
    return _PRCTL is not None and int(_PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def ending_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get `sig` when this process
    dies, or None where the system has no such signal (nothing to run).

    A parent that died between the fork and the call leaves the child
    re-parented already: it exits at once instead of running unwatched."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
