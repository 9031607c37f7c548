"""The worker's decode processes: a process pool whose pipes hold a job.

A decode job carries a chunk's record values (~1.3 MB for 2,048 records of
~640 bytes) and its result a hashed batch (~1 MB). Through Linux's default
64 KiB pipes each crosses in some twenty writes, every one a wakeup of the
other process and, on the worker's side, a GIL hand-off to the pool's feeder
or result thread while the event loop trains. 1 MiB pipes make that two or
three (in-process training 111k events/s against 105k over 100k events,
four interleaved pairs of runs).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing
import signal

__all__ = ["PIPE_BYTES", "start_decode_pool", "widen_pipes"]

PIPE_BYTES = 1 << 20
"""Buffer size asked for the job and result pipes (Linux's default limit for
an unprivileged process, ``/proc/sys/fs/pipe-max-size``)."""


def _ignore_stop_signals() -> None:
    """Decode processes leave stopping to the worker: Ctrl-C and a group-wide
    SIGTERM reach them too, and the worker still needs them to flush."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
    """`processes` spawned decode processes that ignore stop signals, with wide pipes."""
    pool = concurrent.futures.ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_ignore_stop_signals,
    )
    widen_pipes(pool)
    return pool
