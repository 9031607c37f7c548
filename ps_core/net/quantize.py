"""How values and counts travel compressed in a frame (format version 2).

Value types (`VALUE_TYPES`):

- ``f32``: float32, exact: the reference.
- ``f16``: IEEE float16 (pulls and pushes). Magnitudes above 65504 are
  clipped to ±65504 and counted (`Quantized.clipped`).
- ``int8``: pushes only. The values, flattened row by row, are cut into
  blocks of `BLOCK` (64); each block travels as one float32 scale
  (max |x| / 127) and 64 int8 codes, x ≈ code · scale: 1.06 bytes a value.

Rounding of gradients is unbiased by default (``stochastic``: a value
rounds up with the probability of its distance to the lower neighbour, so
its expectation is the float32 value); ``nearest`` is for weights (a pull's
reply, a serving file) and for error feedback (`ps_core.net.feedback`),
which carries the rounding error to the key's next push instead. NaN and
infinity are refused in every type: `InvalidValuesError`, nothing is sent.

Counts (shows, clicks) are whole numbers in practice; `compact_counts`
picks the narrowest unsigned type that holds them exactly (u8, u16, u32, or
u8 with the few rows that do not fit escaped) and keeps float32 when they
are fractional or negative.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..errors import FrameError, InvalidValuesError

__all__ = [
    "BLOCK",
    "COUNT_TYPES",
    "F16_MAX",
    "PULL_VALUE_TYPES",
    "Quantized",
    "Rounding",
    "VALUE_TYPES",
    "compact_counts",
    "count_section_size",
    "dequantize",
    "quantize",
    "read_counts",
    "value_section_size",
]

F32 = npt.NDArray[np.float32]
Rounding = Literal["stochastic", "nearest"]

VALUE_TYPES = ("f32", "f16", "int8")
"""Value types by their code in a frame header (0, 1, 2)."""
PULL_VALUE_TYPES = ("f32", "f16")
"""Value types a pull's reply may travel in: weights are read exactly or
rounded to float16, never int8 (a block's scale would follow its largest)."""
COUNT_TYPES = ("f32", "u8", "u16", "u32", "u8+")
"""Count types by their code in a frame header (0..4); ``u8+`` is u8 with
the rows that do not fit escaped to float32 (`compact_counts`)."""
BLOCK = 64
"""Values per int8 block (one float32 scale each)."""
F16_MAX = float(np.finfo(np.float16).max)  # 65504
_TOP_FLOOR = np.float32(2.0**-100)
_COUNT_DTYPES = (np.dtype("<f4"), np.dtype(np.uint8), np.dtype("<u2"), np.dtype("<u4"))


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class Quantized:
    """One values section ready for a frame."""

    vtype: int
    """Its value type's code (an index of `VALUE_TYPES`)."""
    data: bytes
    """The section's bytes, padded to a multiple of 8."""
    clipped: int = 0
    """Values clipped to the float16 range."""


def value_section_size(vtype: int, count: int) -> int:
    """Bytes of a values section of `count` values (padded to 8)."""
    if vtype == 0:
        return _pad8(4 * count)
    if vtype == 1:
        return _pad8(2 * count)
    return _pad8(4 * _blocks(count)) + _pad8(count)


def _blocks(count: int) -> int:
    return (count + BLOCK - 1) // BLOCK


def _check_finite(values: F32) -> None:
    if values.size and not np.isfinite(values).all():
        bad = int(values.size - np.isfinite(values).sum())
        raise InvalidValuesError(f"{bad} values are NaN or infinite: refused before sending")


def _stochastic_f16(x: F32, rng: np.random.Generator, magnitude: F32 | None = None) -> npt.NDArray[np.float16]:
    """Round to float16 up or down with the probabilities that keep the mean.

    Normal float16 values keep 10 of float32's 23 mantissa bits: adding a
    uniform 13-bit integer to the float32 bits, then clearing those 13 bits,
    rounds the magnitude up with probability (the dropped bits) / 2**13,
    which is the distance to the lower neighbour in steps (a carry into the
    exponent is the next binade's first value, as it should be). Below
    float16's smallest normal (2**-14) its grid is even (2**-24 apart): those
    few values are rounded on it directly. `magnitude` is ``abs(x)`` when
    the caller has it."""
    bits = x.view(np.uint32)
    # 13 random bits per value: each 64-bit draw of the generator read as
    # four uint16 (rng.integers costs 3x as much at a mini-batch's size).
    raw = rng.bit_generator.random_raw((x.size + 3) // 4).view(np.uint16)[: x.size]
    y = ((bits + (raw & np.uint16(0x1FFF))) & np.uint32(0xFFFFE000)).view(np.float32)
    small = (np.abs(x) if magnitude is None else magnitude) < np.float32(2.0**-14)
    if small.any():
        tiny = np.flatnonzero(small)
        scaled = x[tiny] * np.float32(2.0**24)
        y[tiny] = np.floor(scaled + rng.random(tiny.size, dtype=np.float32)) * np.float32(2.0**-24)
    return y.astype(np.float16)


def _quantize_f16(x: F32, rounding: Rounding, rng: np.random.Generator | None) -> Quantized:
    # One reduction checks both bounds: the largest magnitude is NaN or
    # infinite if any value is, and beyond F16_MAX if any must be clipped.
    magnitude = np.abs(x)
    clipped = 0
    if x.size and not magnitude.max() <= F16_MAX:
        _check_finite(x)
        clipped = int((magnitude > F16_MAX).sum())
        x = np.clip(x, -F16_MAX, F16_MAX)
        magnitude = np.abs(x)
    if rounding == "stochastic":
        h = _stochastic_f16(x, rng if rng is not None else np.random.default_rng(), magnitude)
    else:
        h = x.astype(np.float16)
    return Quantized(1, _padded(h.astype("<f2", copy=False).tobytes()), clipped)


def quantize(
    values: npt.ArrayLike, vtype: int, rounding: Rounding, rng: np.random.Generator | None = None
) -> Quantized:
    """Encode float values (any shape, read row by row) as a section of type `vtype`."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if vtype == 1:
        return _quantize_f16(x, rounding, rng)
    if vtype == 0:
        _check_finite(x)
        return Quantized(0, _padded(x.astype("<f4", copy=False).tobytes()))
    if rounding == "stochastic" and rng is None:
        rng = np.random.default_rng()
    if vtype != 2:
        raise FrameError(f"unknown value type {vtype}")
    nb = _blocks(x.size)
    padded = np.zeros(nb * BLOCK, dtype=np.float32)
    padded[: x.size] = x
    blocks = padded.reshape(nb, BLOCK)
    top = np.abs(blocks).max(axis=1)
    if nb and not top.max() < np.inf:  # a block's largest is NaN or infinite if any value is
        _check_finite(x)
    # A block of zeros (or of values below 2**-100) is scaled as if its
    # largest were 2**-100: no division by zero, and the codes are still
    # read back with the very scale they were made with (unbiased).
    np.maximum(top, _TOP_FLOOR, out=top)
    scale = top / np.float32(127)
    inv = np.float32(127) / top
    blocks *= inv[:, None]  # in place: `padded` is this call's own
    if rounding == "stochastic" and rng is not None:
        blocks += rng.random(blocks.shape, dtype=np.float32)
        np.floor(blocks, out=blocks)
    else:
        np.rint(blocks, out=blocks)
    np.clip(blocks, -127, 127, out=blocks)  # float error may reach 127.00001
    codes8 = padded.astype(np.int8)[: x.size]
    s = scale.astype("<f4").tobytes()
    c = codes8.tobytes()
    return Quantized(2, s + b"\0" * (_pad8(len(s)) - len(s)) + c + b"\0" * (_pad8(len(c)) - len(c)))


def dequantize(buf: memoryview, offset: int, vtype: int, count: int) -> F32:
    """The float32 values of a section written by `quantize` (a read-only
    view for f32, a new array otherwise); `FrameError` on NaN or infinity."""
    if vtype == 0:
        return np.frombuffer(buf, dtype="<f4", count=count, offset=offset)
    if vtype == 1:
        h = np.frombuffer(buf, dtype="<f2", count=count, offset=offset)
        out = h.astype(np.float32)
    elif vtype == 2:
        nb = _blocks(count)
        scale = np.frombuffer(buf, dtype="<f4", count=nb, offset=offset)
        codes = np.frombuffer(buf, dtype=np.int8, count=count, offset=offset + _pad8(4 * nb))
        if count and (codes == -128).any():
            raise FrameError("int8 code -128 is outside the format's -127..127")
        full = np.zeros(nb * BLOCK, dtype=np.float32)
        full[:count] = codes
        out = (full.reshape(nb, BLOCK) * scale[:, None]).reshape(-1)[:count]
    else:
        raise FrameError(f"unknown value type {vtype}")
    if out.size and not np.isfinite(out).all():
        raise FrameError("values section holds NaN or infinity")
    return out


def compact_counts(counts: npt.ArrayLike) -> tuple[int, bytes]:
    """(count type code, section bytes padded to 8) for (n, 2) shows and clicks.

    Whole non-negative counts up to 255 travel as u8. A mini-batch's few
    frequent keys (its bias key shows every event) would otherwise widen
    every key's counts, so when at most an eighth of the rows do not fit,
    they are escaped instead (type 4, ``u8+``): their u8 pair is 255, 255
    and their float32 pair follows in an overflow list."""
    c = np.ascontiguousarray(counts, dtype=np.float32).reshape(-1, 2)
    if c.size == 0:
        return 1, b""
    # One cast and two comparisons find the rows that are not whole numbers
    # 0..254 (NaN, negative, fractional and large ones alike: the cast
    # changed them; 255 is the escape marker). A row's two bools read as one
    # uint16 are nonzero when either is: one flatnonzero finds the rows
    # (`.any(axis=1)` is 20x slower on 2 columns).
    with np.errstate(invalid="ignore", over="ignore"):
        small = c.astype(np.uint8)
    bad = (small != c) | (small == 255)
    over = np.flatnonzero(bad.view(np.uint16))
    if over.size == 0:
        return 1, _padded(small.tobytes())
    if over.size * 8 <= c.shape[0]:
        big = c[over]
        # Whole, not negative, finite (NaN fails every comparison).
        if bool(((big >= 0) & (big < np.inf) & (big == np.floor(big))).all()):
            return 4, _escaped(small, over, big)
    flat = c.reshape(-1)
    _check_finite(flat)
    code = 0
    if flat.min() >= 0 and (flat == np.floor(flat)).all():
        top = flat.max()
        code = 1 if top < 256 else 2 if top < 2.0**16 else 3 if top < 2.0**32 else 0
    return code, _padded(flat.astype(_COUNT_DTYPES[code], copy=False).tobytes())


def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (_pad8(len(raw)) - len(raw))


def _escaped(small: npt.NDArray[np.uint8], over: npt.NDArray[np.intp], big: F32) -> bytes:
    """A ``u8+`` section: k (u32, u32 zero), the u8 pairs (255 for the rows
    in the overflow list), then the k row numbers (u32) and their f32 pairs
    `big`; `small` (this call's own cast) is marked in place."""
    small[over] = 255
    parts = [
        struct.pack("<II", over.size, 0),
        small.tobytes(),
        over.astype("<u4").tobytes(),
        big.astype("<f4").tobytes(),
    ]
    return b"".join(p + b"\0" * (_pad8(len(p)) - len(p)) for p in parts)


def count_section_size(ctype: int, n: int, buf: memoryview | None = None, offset: int = 0) -> int:
    """Bytes of a counts section of `n` rows (padded to 8 in format 2); a
    ``u8+`` section's size depends on its overflow count, read from `buf`."""
    if ctype != 4:
        return _pad8(2 * n * _COUNT_DTYPES[ctype].itemsize)
    if buf is None or len(buf) < offset + 8:
        raise FrameError("frame truncated before its counts' overflow count")
    k = int(struct.unpack_from("<I", buf, offset)[0])
    if k > n:
        raise FrameError(f"counts overflow list of {k} rows in a push of {n}")
    return 8 + _pad8(2 * n) + _pad8(4 * k) + 8 * k


def read_counts(buf: memoryview, offset: int, ctype: int, n: int) -> F32:
    """(n, 2) float32 shows and clicks of a counts section."""
    if ctype == 4:
        (k,) = struct.unpack_from("<I", buf, offset)
        pos = offset + 8
        small = np.frombuffer(buf, dtype=np.uint8, count=2 * n, offset=pos).reshape(n, 2)
        pos += _pad8(2 * n)
        rows = np.frombuffer(buf, dtype="<u4", count=k, offset=pos)
        pos += _pad8(4 * k)
        big = np.frombuffer(buf, dtype="<f4", count=2 * k, offset=pos).reshape(k, 2)
        if k and (rows >= n).any():
            raise FrameError("counts overflow list names a row beyond the push")
        out = small.astype(np.float32)
        out[rows] = big
        return out
    if not 0 <= ctype < len(_COUNT_DTYPES):
        raise FrameError(f"unknown count type {ctype}")
    raw = np.frombuffer(buf, dtype=_COUNT_DTYPES[ctype], count=2 * n, offset=offset)
    out = raw.astype(np.float32, copy=False)  # float32 counts stay a view
    return out.reshape(n, 2)
