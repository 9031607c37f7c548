"""Stable 64-bit hashes of strings, vectorised (`string_hashes`): the
categorical values and field names a `FeatureHasher` turns into feature ids.
Also `collector_paused`, which hashing a chunk runs under."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from ..hashing import U64, mix64
from .batch import I64

__all__ = ["string_hashes", "joined_hashes", "collector_paused", "GRID_WIDTH"]


_MULTS = np.zeros(0, dtype=np.uint64)


def _multipliers(width: int) -> U64:
    global _MULTS
    if _MULTS.size < width:
        # Odd 64-bit multipliers, one per code-point position: a pure function
        # of the position, so hashes never depend on the batch.
        _MULTS = mix64(np.arange(1, max(width, 64) + 1, dtype=np.uint64), 0x2545F4914F6CDD1D) | np.uint64(1)
    return _MULTS[:width]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused for the block (then as it was).

    Hashing a chunk allocates many containers, none in a cycle; each
    collector pass on the way would walk every object alive, and a caller
    holding millions of event dicts (a `Learner`'s list, a decode's parsed
    chunk) makes each pass cost more than the hashing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def string_hashes(strings: Sequence[str] | npt.NDArray[np.object_]) -> U64:
    """Stable 64-bit hashes of strings: ``fmix64(sum_i cp_i * M_i)`` over the
    code points ``cp_i`` with fixed odd multipliers ``M_i`` (mod 2**64).

    Vectorised, from one NUL-separated buffer of the strings' code points (a
    byte each when all are ASCII, else UTF-32): strings all of one length
    are its rows, hashed by a multiply-add per column; strings of at most
    `GRID_WIDTH` code points are windows of it, the rows of a matrix hashed
    alike up to each string's length; longer ones have each code point multiplied
    by the multiplier of its position within its string and summed per
    string by ``np.add.reduceat``.
    """
    seq = strings.tolist() if isinstance(strings, np.ndarray) else strings
    if len(seq) == 0:
        return np.zeros(0, dtype=np.uint64)
    # One buffer, each string followed by a NUL: boundaries come from the
    # buffer itself instead of a len() per string.
    return joined_hashes("\0".join(seq) + "\0", seq)


GRID_WIDTH = 64
"""Longest strings hashed as a matrix of code points (`string_hashes`): the
matrix costs the longest string's width for every string, so a chunk with a
longer one takes the buffer path instead."""


def joined_hashes(joined: str, seq: Sequence[str]) -> U64:
    """`string_hashes` of `seq` (not empty), given ``"\\0".join(seq) + "\\0"``:
    strings all of one length (hex ids, say) straight from that buffer as a
    matrix; else as windows of it (`_windows`); else the buffer."""
    cps = _code_points(joined)
    n = len(seq)
    width = cps.size // n
    if width * n == cps.size:
        grid = cps.reshape(n, width)
        # NULs exactly at the end of every row: all strings have length
        # width - 1, so each row is a string and its terminator.
        if not grid[:, -1].any() and np.count_nonzero(cps) == n * (width - 1):
            return _column_hashes(grid[:, : width - 1])
    ends = np.flatnonzero(cps == 0)
    if ends.size != n:  # some string holds a NUL: take lengths the slow way
        ends = np.cumsum(np.fromiter(map(len, seq), dtype=np.int64, count=n) + 1) - 1
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts
    longest = int(lens.max())
    if longest <= GRID_WIDTH:
        return _column_hashes(_windows(cps, starts, max(longest, 1)), lens)
    return _buffer_hashes(cps, starts, lens)


def _code_points(joined: str) -> npt.NDArray[np.uint8] | npt.NDArray[np.uint32]:
    """The code points of `joined`: a byte each when ASCII (the usual
    alphabet of ids, a quarter of UTF-32 to scan), else UTF-32."""
    if joined.isascii():
        return np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(joined.encode("utf-32-le"), dtype="<u4")


def _windows(
    cps: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], starts: I64, width: int
) -> npt.NDArray[np.uint8] | npt.NDArray[np.uint32]:
    """The `width` code points of the buffer `cps` from each of `starts`, as
    the rows of a matrix: a string, then its terminator and what follows."""
    padded = np.concatenate((cps, np.zeros(width, dtype=cps.dtype)))
    # One gather in C from windows of the buffer: no copy from each string object.
    return sliding_window_view(padded, width)[starts]


def _column_hashes(grid: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], lens: I64 | None = None) -> U64:
    """`H` of each row of code points: all of a row (zero padding adds
    nothing), or with `lens` its first ``lens[row]`` only."""
    n, width = grid.shape
    mults = _multipliers(max(width, 1)).tolist()
    short = width if lens is None else int(lens.min())
    acc = np.zeros(n, dtype=np.uint64)  # a column at a time: no (n, width) uint64 temporary
    for i in range(width):  # per column (at most GRID_WIDTH, or one length), not per string
        if i < short or lens is None:
            acc += grid[:, i] * np.uint64(mults[i])
        else:  # only the rows whose string is this long: the rest hold others' code points
            rows = np.flatnonzero(lens > i)
            acc[rows] += grid[rows, i] * np.uint64(mults[i])
    return mix64(acc)


def _buffer_hashes(cps: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], starts: I64, lens: I64) -> U64:
    """`string_hashes` of the strings at `starts` (of `lens` code points) in
    the NUL-separated buffer `cps`."""
    seg_lens = lens + 1  # including the terminator, so never empty
    # Position of each code point within its own string; terminators are 0 and add nothing.
    rel = np.arange(cps.size, dtype=np.int64) - np.repeat(starts, seg_lens)
    prod = cps.astype(np.uint64) * _multipliers(int(seg_lens.max()))[rel]
    return mix64(np.add.reduceat(prod, starts))
