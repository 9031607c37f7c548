"""The binary frame of the shard RPC (format versions 1 and 2).

Bulk keys and values never travel as JSON. A frame is a fixed 48-byte header,
the table name, zero padding to a multiple of 8 bytes, then raw little-endian
arrays::

    offset size  field
    0      4     magic b"CTPS"
    4      1     format version (1)
    5      1     op: 1 pull request, 2 push request, 3 weights reply, 4 push ack,
                 5 push_pull request, 6 push_pull reply, 7 changes request,
                 8 changes reply
    6      2     flags: bit 0 = a counts array follows the values (push,
                 push_pull); bit 1 = presence: in a pull request, asks for it;
                 in a weights reply, a presence array follows the values;
                 bit 2 = in a push_pull request, pull the pushed keys (m = 0,
                 no pull keys section: a geo worker reads back what it pushed);
                 bit 5 = in a changes reply, complete (below)
    8      4     count n: keys in a pull or push request, push keys in a
                 push_pull request, rows in a weights or push_pull reply,
                 distinct keys applied in a push ack
    12     4     dim: values per key (0 in a pull request and a push ack; a
                 push_pull request's push dim, which may be 0 when n = 0)
    16     8     event_time, float64 seconds (push, push_pull; 0 = the shard's clock)
    24     8     uint64: in replies, version: the table's open export version;
                 in push and push_pull requests, base clock: the table clock
                 of the pull the gradients were computed from (0 = unknown)
    32     8     uint64: in requests, request_id: a push's id for retry dedup
                 (0 = none); in weights and push_pull replies, clock: the
                 table's clock (pushes applied) when the weights were read
    40     2     name length L (bytes of UTF-8)
    42     1     format 2: bits 0..3 the values section's type, bits 4..7
                 (pull and push_pull requests) the type the reply's weights
                 should travel in: 0 f32, 1 f16, 2 int8 (`ps_core.net.quantize`);
                 format 1: zero
    43     1     format 2: the counts section's type: 0 f32, 1 u8, 2 u16,
                 3 u32, 4 u8 with escaped rows (`ps_core.net.quantize`);
                 format 1: zero
    44     4     count m: pull keys in a push_pull request, distinct keys
                 applied in a push_pull reply; 0 for every other op
    48     L     table name, then zero padding to the next multiple of 8
    ...    8n    keys, uint64            (pull, push and push_pull requests)
    ...    8m    pull keys, uint64       (push_pull request)
    ...    4n·d  values, float32 (n, d)  (push and push_pull requests: gradients;
                                          weights and push_pull replies: weights)
    ...    8n    counts, float32 (n, 2)  (push or push_pull request with flag
                                          bit 0: shows, clicks)
    ...    n     presence, uint8 0/1, then zero padding to a multiple of 8
                                     (weights reply with flag bit 1: the key has a row)

A push_pull request is a push of n keys and a pull of m keys of the same
table in one frame; the shard applies the push, then answers the pull, as a
push request followed by a pull request would. Its two key arrays come
before the float32 sections so that both stay 8-byte aligned whatever n·d is.

The clocks let a shard count how stale each applied gradient is (pushes
applied to the table between the pull and the push). They were added within
format version 1 in bytes that every earlier writer zeroed in those frames
and no reader checked: an older peer sends 0 (unknown: not counted) and
ignores what it receives.

Flag bit 2 was added within format version 1 too: a reader that predates it
refuses the frame ("unknown flags") rather than answering an empty pull.

Ops 7 and 8 (a geo table's changed keys, `ps_core.store.change_log`) were
added within format version 1 the same way, with flag bit 5 valid in op 8
only. A changes request's keys section holds the request ids of the
asker's own pushes (n of them), bytes 24..31 the log incarnation of its
last answer and 32..39 that answer's sequence number; the reply's keys
section holds the changed keys (n), bytes 24..31 the log's incarnation and
32..39 its sequence number now, and flag bit 5 says the keys are complete
(clear: take every row as changed). Neither carries values (dim 0).

Ops 5 and 6 were added within format version 1: every earlier frame still
decodes unchanged (its writers zeroed bytes 42..47, which were reserved), and
a reader that predates them refuses them as an unknown op rather than
misreading them, so no version bump was needed.

**Format 2** is what a frame becomes when it uses any of: values other than
float32, narrowed counts, a reply in float16, or key sets (flags 3 and 4).
Otherwise a writer still writes format 1, so a client left at float32 talks
to shards that predate format 2. Its differences:

- bytes 42..43 say the value and count types (above);
- every section is zero-padded to a multiple of 8 bytes, so each starts
  aligned whatever its type; an int8 values section is the blocks' float32
  scales (padded to 8), then the int8 codes;
- flag bit 3 (push and push_pull requests): the push's keys section is a
  single uint64, the id of a key set the shard remembered, and n says how
  many keys it holds; with flag bit 2 the pull reads that set too;
- flag bit 4 (pull and push_pull requests): the shard remembers the pull's
  keys under the request id (bytes 32..39, nonzero) for one push that
  names them (`ps_core.shard.key_sets`).

A peer that reads format 1 only refuses a format 2 frame by its version
byte ("unsupported frame format version 2"): it never misreads one.

A reader checks magic, version, op, and that the length is exactly what the
header implies; any mismatch is a `FrameError` and nothing is applied. Arrays
are read zero-copy with ``np.frombuffer``: uint64 sections start at a
multiple of 8, float32 ones at a multiple of 4.
"""

from __future__ import annotations

import struct
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import FrameError
from .frame import Frame
from .quantize import (
    COUNT_TYPES,
    PULL_VALUE_TYPES,
    VALUE_TYPES,
    Quantized,
    compact_counts,
    count_section_size,
    dequantize,
    read_counts,
    value_section_size,
)

__all__ = [
    "op_of",
    "FORMAT_VERSION",
    "MAGIC",
    "Op",
    "Frame",
    "encode",
    "decode",
    "FLAG_COUNTS",
    "FLAG_PRESENCE",
    "FLAG_PULL_PUSHED",
    "FLAG_KEYS_REF",
    "FLAG_REMEMBER",
    "FLAG_COMPLETE",
    "FORMAT_VERSIONS",
    "MAX_NAME",
]

MAGIC = b"CTPS"
FORMAT_VERSION = 2
"""The newest format this peer writes (only when a frame needs it)."""
FORMAT_VERSIONS = (1, 2)
"""The formats this peer reads."""
FLAG_COUNTS = 1
FLAG_PRESENCE = 2
FLAG_PULL_PUSHED = 4
"""A push_pull request pulls the keys it pushes: no pull section follows (m = 0)."""
FLAG_KEYS_REF = 8
"""Format 2: a push's keys section is the id of a remembered key set."""
FLAG_REMEMBER = 16
"""Format 2: the shard keeps the request's pull keys under its request id."""
FLAG_COMPLETE = 32
"""A changes reply holds every changed key (else: take every row as changed)."""
_FLAGS_V1 = FLAG_COUNTS | FLAG_PRESENCE | FLAG_PULL_PUSHED | FLAG_COMPLETE
_FLAGS_V2 = _FLAGS_V1 | FLAG_KEYS_REF | FLAG_REMEMBER
MAX_NAME = 255
_HEADER = struct.Struct("<4sBBHIIdQQHBBI")
HEADER_SIZE = _HEADER.size  # 48


class Op:
    """Frame operations."""

    PULL = 1
    PUSH = 2
    WEIGHTS = 3
    ACK = 4
    PUSH_PULL = 5
    """A push and then a pull of the same table, in one request."""
    PUSH_PULL_REPLY = 6
    """The push's applied count and the pull's weights."""
    CHANGES = 7
    """A geo table's keys changed since an earlier answer (`ps_core.store.change_log`)."""
    CHANGES_REPLY = 8
    """The changed keys, the log's sequence number and incarnation."""


_OPS = {Op.PULL, Op.PUSH, Op.WEIGHTS, Op.ACK, Op.PUSH_PULL, Op.PUSH_PULL_REPLY, Op.CHANGES, Op.CHANGES_REPLY}
_LOGGED = (Op.CHANGES, Op.CHANGES_REPLY)
"""Ops whose bytes 24..31 hold a change log's incarnation and 32..39 a sequence number."""
_CLOCKED_REQUESTS = (Op.PUSH, Op.PUSH_PULL)
"""Requests whose bytes 24..31 hold the base clock."""
_CLOCKED_REPLIES = (Op.WEIGHTS, Op.PUSH_PULL_REPLY)
"""Replies whose bytes 32..39 hold the table's clock."""
_KEYED = (Op.PULL, Op.PUSH, Op.PUSH_PULL, Op.CHANGES, Op.CHANGES_REPLY)
"""Ops with a keys section."""
_VALUED = (Op.PUSH, Op.WEIGHTS, Op.PUSH_PULL, Op.PUSH_PULL_REPLY)
"""Ops with a values section."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _zeros_to8(n: int) -> bytes:
    return b"\0" * (_pad8(n) - n)


def encode(
    op: int,
    table: str,
    *,
    keys: npt.NDArray[np.uint64] | None = None,
    values: npt.NDArray[np.float32] | Quantized | None = None,
    dim: int | None = None,
    counts: npt.NDArray[np.float32] | None = None,
    count: int | None = None,
    event_time: float = 0.0,
    version: int = 0,
    request_id: int = 0,
    presence: bool = False,
    present: npt.NDArray[np.bool_] | None = None,
    pull_keys: npt.NDArray[np.uint64] | None = None,
    applied: int = 0,
    clock: int = 0,
    pull_pushed: bool = False,
    keys_ref: int = 0,
    remember: bool = False,
    reply_vtype: int = 0,
    compact: bool = False,
    complete: bool = False,
) -> bytes:
    """Encode one frame; arrays are converted to little-endian as needed.

    `presence` flags a pull that asks for presence; `present` is the reply's
    presence array (and sets the flag). `pull_keys` (a push_pull request) and
    `applied` (a push_pull reply) fill count m at offset 44. `clock` goes
    where the op carries it (the module docstring).

    Format 2 is written only when a frame uses it: `values` already
    quantized (`ps_core.net.quantize.quantize`, with `dim` its values per
    key), `compact` counts, `keys_ref` (the push's keys are the set
    remembered under that id; `keys` then only sets n), `remember` (keep the
    pull's keys under `request_id`) or a `reply_vtype` other than f32."""
    if clock:
        version, request_id = _place_clock(op, clock, version, request_id)
    name = table.encode("utf-8")
    if len(name) > MAX_NAME:
        raise FrameError(f"table name longer than {MAX_NAME} bytes")
    vtype = values.vtype if isinstance(values, Quantized) else 0
    ctype, counts_raw = (0, b"") if counts is None else _counts_section(counts, compact)
    if remember and not request_id:
        raise FrameError("a pull to remember needs a request id to remember it under")
    v2 = bool(vtype or reply_vtype or ctype or compact or keys_ref or remember)
    parts: list[bytes] = []
    n = count
    if keys is not None:
        k = np.ascontiguousarray(keys, dtype="<u8").reshape(-1)
        n = k.size if n is None else n
        parts.append(struct.pack("<Q", keys_ref) if keys_ref else k.tobytes())
    m = applied
    if pull_keys is not None:
        pk = np.ascontiguousarray(pull_keys, dtype="<u8").reshape(-1)
        m = pk.size
        parts.append(pk.tobytes())
    width = 0
    if values is not None:
        n, width = _values_section(parts, values, dim, count, n, v2)
    flags = (
        (FLAG_COUNTS if counts is not None else 0)
        | (FLAG_PRESENCE if presence or present is not None else 0)
        | (FLAG_PULL_PUSHED if pull_pushed else 0)
        | (FLAG_KEYS_REF if keys_ref else 0)
        | (FLAG_REMEMBER if remember else 0)
        | (FLAG_COMPLETE if complete else 0)
    )
    if counts is not None:
        parts.append(counts_raw)
    if present is not None:
        pr = np.ascontiguousarray(present, dtype=np.uint8).reshape(-1)
        parts.append(pr.tobytes() + _zeros_to8(pr.size))
    header = _HEADER.pack(
        MAGIC, 2 if v2 else 1, op, flags, n or 0, width, event_time, version, request_id, len(name),
        vtype | reply_vtype << 4, ctype, m,
    )  # fmt: skip
    return b"".join([header, name, _zeros_to8(len(name)), *parts])


def _place_clock(op: int, clock: int, version: int, request_id: int) -> tuple[int, int]:
    """(version, request_id) with `clock` in the slot `op` carries it in."""
    if op in _CLOCKED_REQUESTS:
        return clock, request_id
    if op in _CLOCKED_REPLIES:
        return version, clock
    raise FrameError(f"op {op} carries no clock")


def _counts_section(counts: npt.NDArray[np.float32], compact: bool) -> tuple[int, bytes]:
    """The counts section's type and bytes: narrowed when `compact`, else float32 (n, 2)."""
    if compact:
        return compact_counts(counts)
    return 0, np.ascontiguousarray(counts, dtype="<f4").reshape(-1, 2).tobytes()


def _values_section(
    parts: list[bytes],
    values: npt.NDArray[np.float32] | Quantized,
    dim: int | None,
    count: int | None,
    n: int | None,
    v2: bool,
) -> tuple[int | None, int]:
    """Append the values section to `parts`; returns n and the values per key."""
    if isinstance(values, Quantized):
        if dim is None:
            raise FrameError("quantized values need their dim")
        n = count if count is not None else (n if n is not None else 0)
        data = values.data
        if not v2:  # a float32 section of format 1 is not padded
            data = data[: 4 * n * dim]
        parts.append(data)
        return n, dim
    v = np.ascontiguousarray(values, dtype="<f4")
    if v.ndim == 1:
        v = v.reshape(-1, 1)
    n = int(v.shape[0]) if n is None else n
    raw = v.tobytes()
    parts.append(raw + _zeros_to8(len(raw)) if v2 else raw)
    return n, int(v.shape[1])


_A = TypeVar("_A", bound=np.ndarray)


def _readonly(a: _A) -> _A:
    # A view of a writable buffer (bytearray) would be writable; frames are not.
    a.flags.writeable = False
    return a


def op_of(body: bytes | bytearray | memoryview) -> int | None:
    """The op byte of a frame not decoded yet (offset 5; None when `body` is
    too short to hold it): what a port checks a token's scope against before
    the frame is decoded and handled."""
    return body[5] if len(body) > 5 else None


def decode(buf: bytes | bytearray | memoryview, expect_op: int | None = None) -> Frame:
    """Decode and check one frame; raises `FrameError` on any inconsistency."""
    mv = memoryview(buf)
    if len(mv) < HEADER_SIZE:
        raise FrameError(f"frame of {len(mv)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, ver, op, flags, n, dim, event_time, version, request_id, name_len, types, ctype, m = _HEADER.unpack_from(
        mv, 0
    )
    vtype, reply_vtype = types & 0xF, types >> 4
    _check_known(magic, ver, op, expect_op, flags, vtype, reply_vtype, ctype, m)
    table = _table_name(mv, name_len)
    if flags or types or ctype:  # each check there needs one of them
        _check_flags(op, flags, vtype, reply_vtype, ctype, request_id)
    keys, ref, pull_keys, values, counts, present = _sections(
        mv, op, flags, n, dim, m, vtype, ctype, ver == 2, name_len
    )
    clock = incarnation = 0
    if op in _CLOCKED_REQUESTS:
        clock, version = version, 0
    elif op in _CLOCKED_REPLIES:
        clock, request_id = request_id, 0
    elif op in _LOGGED:
        incarnation, clock, version, request_id = version, request_id, 0, 0
    return Frame(
        op=op,
        table=table,
        count=n,
        dim=dim,
        keys=keys,
        values=values,
        counts=counts,
        event_time=float(event_time),
        version=int(version),
        request_id=int(request_id),
        clock=int(clock),
        presence=bool(flags & FLAG_PRESENCE),
        present=present,
        pull_keys=pull_keys,
        applied=int(m) if op == Op.PUSH_PULL_REPLY else 0,
        keys_ref=int(ref),
        remember=bool(flags & FLAG_REMEMBER),
        value_type=vtype,
        reply_value_type=reply_vtype,
        format_version=ver,
        pull_pushed=bool(flags & FLAG_PULL_PUSHED),
        incarnation=int(incarnation),
        complete=bool(flags & FLAG_COMPLETE),
    )


def _check_known(
    magic: bytes, ver: int, op: int, expect_op: int | None, flags: int, vtype: int, reply_vtype: int, ctype: int, m: int
) -> None:
    """`FrameError` unless the header's magic, version, op (`expect_op` if
    given), flags and types are known to this peer, in that frame's format."""
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if ver not in FORMAT_VERSIONS:
        raise FrameError(
            f"unsupported frame format version {ver} (this peer speaks {', '.join(map(str, FORMAT_VERSIONS))})"
        )
    if op not in _OPS:
        raise FrameError(f"unknown op {op}")
    if expect_op is not None and op != expect_op:
        raise FrameError(f"expected op {expect_op}, got {op}")
    v2 = ver == 2
    if flags & ~(_FLAGS_V2 if v2 else _FLAGS_V1):
        raise FrameError(f"unknown flags {flags:#x}" + ("" if v2 else " in a format 1 frame"))
    if not v2 and (vtype or reply_vtype or ctype):
        raise FrameError("bytes 42..43 are reserved (zero) in a format 1 frame")
    if vtype >= len(VALUE_TYPES) or reply_vtype >= len(PULL_VALUE_TYPES) or ctype >= len(COUNT_TYPES):
        raise FrameError(f"unknown value type {vtype}, reply value type {reply_vtype} or count type {ctype}")
    if flags & FLAG_PULL_PUSHED and (op != Op.PUSH_PULL or m):
        raise FrameError(f"flag {FLAG_PULL_PUSHED:#x} is for a push_pull request without pull keys")
    if m and op not in (Op.PUSH_PULL, Op.PUSH_PULL_REPLY):
        raise FrameError(f"op {op} carries no second count but bytes 44..47 hold {m}")


def _check_flags(op: int, flags: int, vtype: int, reply_vtype: int, ctype: int, request_id: int) -> None:
    """`FrameError` unless `op` may carry the flags and types it has."""
    if flags & FLAG_COUNTS and op not in (Op.PUSH, Op.PUSH_PULL):
        raise FrameError("only a push carries counts")
    if ctype and not flags & FLAG_COUNTS:
        raise FrameError(f"count type {ctype} without counts")
    if flags & FLAG_PRESENCE and op not in (Op.PULL, Op.WEIGHTS):
        raise FrameError(f"unknown flags {FLAG_PRESENCE:#x} for op {op}: only pulls carry presence")
    if flags & FLAG_KEYS_REF and op not in (Op.PUSH, Op.PUSH_PULL):
        raise FrameError(f"flag {FLAG_KEYS_REF:#x} is for a push's keys")
    if flags & FLAG_REMEMBER and (op not in (Op.PULL, Op.PUSH_PULL) or not request_id):
        raise FrameError(f"flag {FLAG_REMEMBER:#x} is for a pull with a request id")
    if flags & FLAG_COMPLETE and op != Op.CHANGES_REPLY:
        raise FrameError(f"flag {FLAG_COMPLETE:#x} is for a changes reply")
    if reply_vtype and op not in (Op.PULL, Op.PUSH_PULL):
        raise FrameError(f"op {op} asks for no reply values")
    if vtype and op not in _VALUED:
        raise FrameError(f"op {op} carries no values but its value type is {vtype}")
    if vtype == 2 and op not in (Op.PUSH, Op.PUSH_PULL):
        raise FrameError("int8 values are for pushes only")


def _table_name(mv: memoryview, name_len: int) -> str:
    if name_len == 0 or name_len > MAX_NAME:
        raise FrameError(f"table name length {name_len} outside 1..{MAX_NAME}")
    name_end = HEADER_SIZE + name_len
    if len(mv) < name_end:
        raise FrameError("frame truncated inside the table name")
    try:
        return bytes(mv[HEADER_SIZE:name_end]).decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("table name is not UTF-8") from None


_Sections = tuple[
    npt.NDArray[np.uint64] | None,
    int,
    npt.NDArray[np.uint64] | None,
    npt.NDArray[np.float32] | None,
    npt.NDArray[np.float32] | None,
    npt.NDArray[np.bool_] | None,
]
"""keys, the id of the key set they are (0: none), pull keys, values, counts, presence."""


def _sections(
    mv: memoryview, op: int, flags: int, n: int, dim: int, m: int, vtype: int, ctype: int, v2: bool, name_len: int
) -> _Sections:
    """The arrays after the name, as read-only views; `FrameError` unless the
    frame is exactly as long as its header implies."""
    has_keys = op in _KEYED
    has_values = op in _VALUED
    has_counts = bool(flags & FLAG_COUNTS)
    presence_reply = bool(flags & FLAG_PRESENCE) and op == Op.WEIGHTS
    keys_ref = bool(flags & FLAG_KEYS_REF)
    if has_values and dim == 0 and n > 0:
        raise FrameError("a frame with values needs dim >= 1")
    if not has_values and dim != 0:
        raise FrameError(f"op {op} carries no values but dim is {dim}")
    start = _pad8(HEADER_SIZE + name_len)
    expected = start
    if has_keys:
        expected += 8 if keys_ref else 8 * n
    if op == Op.PUSH_PULL:
        expected += 8 * m
    values_bytes = counts_bytes = 0
    if has_values:
        values_bytes = value_section_size(vtype, n * dim) if v2 else 4 * n * dim
        expected += values_bytes
    if has_counts:
        counts_bytes = count_section_size(ctype, n, mv, expected)
        expected += counts_bytes
    expected += _pad8(n) if presence_reply else 0
    if len(mv) != expected:
        raise FrameError(
            f"frame is {len(mv)} bytes but its header (n={n}, dim={dim}"
            + (f", m={m}" if op == Op.PUSH_PULL else "")
            + f") implies {expected}"
        )
    pos = start
    keys = values = counts = None
    present = pull_keys = None
    ref = 0
    if has_keys:
        if keys_ref:
            (ref,) = struct.unpack_from("<Q", mv, pos)
            if not ref:
                raise FrameError("a push naming a remembered key set needs its nonzero id")
            pos += 8
        else:
            keys = _readonly(np.frombuffer(mv, dtype="<u8", count=n, offset=pos))
            pos += 8 * n
    if op == Op.PUSH_PULL:
        pull_keys = _readonly(np.frombuffer(mv, dtype="<u8", count=m, offset=pos))
        pos += 8 * m
    if has_values:
        values = _readonly(dequantize(mv, pos, vtype, n * dim).reshape(n, dim))
        pos += values_bytes
    if has_counts:
        counts = _readonly(read_counts(mv, pos, ctype, n))
        pos += counts_bytes
    if flags & FLAG_PULL_PUSHED:
        pull_keys = keys
    if presence_reply:
        raw = np.frombuffer(mv, dtype=np.uint8, count=n, offset=pos)
        if (raw > 1).any():
            raise FrameError("presence bytes must be 0 or 1")
        present = _readonly(raw.view(np.bool_))
    return keys, ref, pull_keys, values, counts, present
