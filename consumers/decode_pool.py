"""The worker's decode processes: a process pool whose pipes hold a job.

A decode job carries a chunk's record values (~1.3 MB for 2,048 records of
~640 bytes) and its result a hashed batch (~1 MB). Through Linux's default
64 KiB pipes each crosses in some twenty writes, every one a wakeup of the
other process and, on the worker's side, a GIL hand-off to the pool's feeder
or result thread while the event loop trains. 1 MiB pipes make that two or
three (in-process training 111k events/s against 105k over 100k events,
four interleaved pairs of runs).

Decode processes end with their worker, even a SIGKILLed one: on Linux the
kernel sends them SIGKILL when it dies (``PR_SET_PDEATHSIG``), and a thread
in each checks that its parent is still the worker, for systems without it.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing
import os
import signal
import threading
import time

from .lifetime import die_with_parent

__all__ = ["PIPE_BYTES", "PARENT_CHECK_S", "start_decode_pool", "widen_pipes"]

PIPE_BYTES = 1 << 20
"""Buffer size asked for the job and result pipes (Linux's default limit for
an unprivileged process, ``/proc/sys/fs/pipe-max-size``)."""


PARENT_CHECK_S = 1.0
"""How often a decode process checks that its worker is alive (the fallback
to ``PR_SET_PDEATHSIG``)."""


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # re-parented: the worker is gone
            os._exit(1)
        time.sleep(PARENT_CHECK_S)


def _init_decoder(parent: int) -> None:
    """Decode processes leave stopping to the worker: Ctrl-C and a group-wide
    SIGTERM reach them too, and the worker still needs them to flush. They
    end when the worker ends, however it ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    # The worker may have died before the death signal was asked for.
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def widen_pipes(pool: concurrent.futures.ProcessPoolExecutor, size: int = PIPE_BYTES) -> bool:
    """Give the pool's job and result pipes `size`-byte buffers; returns
    whether both took it.

    The pipes are the executor's own (its ``_call_queue`` and
    ``_result_queue``, private but stable across Python 3 releases); where
    they are not found, or the kernel refuses the size, the pool keeps its
    default pipes and works as before, only slower.
    """
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:  # not Linux
        return False
    widened = 0
    for queue in (getattr(pool, "_call_queue", None), getattr(pool, "_result_queue", None)):
        try:
            fcntl.fcntl(queue._reader.fileno(), set_size, size)  # type: ignore[union-attr]
            widened += 1
        except (AttributeError, OSError, ValueError):
            pass
    return widened == 2


def start_decode_pool(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    """`processes` spawned decode processes that ignore stop signals and end
    with this process, with wide pipes.

    The death signal is tied to the thread that spawns them: the pool spawns
    from the thread that submits (the event loop's)."""
    pool = concurrent.futures.ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_decoder,
        initargs=(os.getpid(),),
    )
    widen_pipes(pool)
    return pool
