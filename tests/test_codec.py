"""The binary frame codec: round trips of every op, and every malformed frame.

Malformed frames are built by encoding a valid frame and patching bytes at the
header offsets documented in `ps_core.net.codec` (magic 0, version 4, op 5,
flags 6, n 8, dim 12, event_time 16, version 24, request_id 32, name length
40, count m 44, table name 48).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ps_core.errors import FrameError
from ps_core.net import codec, op_encoders
from ps_core.net.codec import FLAG_COUNTS, FLAG_PRESENCE, HEADER_SIZE, MAX_NAME, Op
from ps_core.net.frame import Frame

U64_MAX = 2**64 - 1

# Header field offsets (see the codec docstring).
OFF_VERSION = 4
OFF_OP = 5
OFF_FLAGS = 6
OFF_N = 8
OFF_DIM = 12
OFF_NAME_LEN = 40
OFF_M = 44


def patch(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    """`frame` with the little-endian field `fmt` at `offset` set to `value`."""
    buf = bytearray(frame)
    struct.pack_into("<" + fmt, buf, offset, value)
    return bytes(buf)


def keys_of(*ks: int) -> np.ndarray:
    return np.array(ks, dtype=np.uint64)


def assert_read_only_view(a: np.ndarray | None) -> None:
    assert a is not None
    assert not a.flags.writeable
    assert not a.flags.owndata  # a view of the received bytes, not a copy


# -- header layout -----------------------------------------------------------


def test_header_is_48_bytes_and_sections_are_8_aligned() -> None:
    assert HEADER_SIZE == 48
    for name in ("t", "abcdefgh", "x" * 9):
        buf = op_encoders.encode_pull(name, keys_of(7))
        # header, name padded to 8, one uint64 key
        assert len(buf) == HEADER_SIZE + ((len(name) + 7) // 8) * 8 + 8
        assert buf[:4] == b"CTPS"
        assert buf[OFF_VERSION] == 1  # a frame that needs nothing of format 2 stays format 1
        assert buf[OFF_OP] == Op.PULL


# -- round trips ---------------------------------------------------------------


def test_pull_request_round_trip_with_extreme_keys() -> None:
    keys = keys_of(0, 1, 12345, 2**63, U64_MAX, 0)
    f = codec.decode(op_encoders.encode_pull("lr", keys))
    assert (f.op, f.table, f.count, f.dim) == (Op.PULL, "lr", 6, 0)
    assert f.values is None and f.counts is None
    assert f.keys is not None and f.keys.dtype == np.uint64
    np.testing.assert_array_equal(f.keys, keys)
    assert int(f.keys[4]) == U64_MAX and int(f.keys[0]) == 0
    assert_read_only_view(f.keys)


def test_the_op_byte_is_read_before_decoding() -> None:
    # What the RPC checks a token's scope against, for every op a client sends.
    keys = np.array([1, 2], dtype=np.uint64)
    grads = np.ones((2, 1), dtype=np.float32)
    assert codec.op_of(op_encoders.encode_pull("t", keys)) == Op.PULL
    assert codec.op_of(op_encoders.encode_push("t", keys, grads)) == Op.PUSH
    assert codec.op_of(op_encoders.encode_push_pull("t", keys, grads, keys)) == Op.PUSH_PULL
    assert codec.op_of(b"CTPS\x01") is None  # too short to name an op


def test_empty_pull_request_round_trip() -> None:
    f = codec.decode(op_encoders.encode_pull("lr", keys_of()), expect_op=Op.PULL)
    assert f.count == 0 and f.dim == 0
    assert f.keys is not None and f.keys.shape == (0,)


def test_push_request_round_trip_without_counts() -> None:
    keys = keys_of(0, U64_MAX, 5)
    grads = np.array([[0.5, -1.0], [2.0, 3.0], [-0.25, 1e-30]], dtype=np.float32)
    buf = op_encoders.encode_push("fm_v", keys, grads, event_time=1.7e9 + 0.25, request_id=U64_MAX)
    f = codec.decode(buf, expect_op=Op.PUSH)
    assert (f.op, f.table, f.count, f.dim) == (Op.PUSH, "fm_v", 3, 2)
    np.testing.assert_array_equal(f.keys, keys)
    assert f.values is not None and f.values.dtype == np.float32
    np.testing.assert_array_equal(f.values, grads)
    assert f.counts is None
    assert f.event_time == 1.7e9 + 0.25
    assert f.request_id == U64_MAX
    assert_read_only_view(f.keys)
    assert_read_only_view(f.values)


def test_push_request_round_trip_with_counts() -> None:
    keys = keys_of(3, 4)
    grads = np.array([0.5, -1.5], dtype=np.float32)  # 1-D means dim 1
    counts = np.array([[1, 0], [10, 3]], dtype=np.float32)
    buf = op_encoders.encode_push("lr", keys, grads, counts=counts, request_id=42)
    assert struct.unpack_from("<H", buf, OFF_FLAGS)[0] == FLAG_COUNTS
    f = codec.decode(buf)
    assert f.dim == 1
    np.testing.assert_array_equal(f.values, grads.reshape(-1, 1))
    assert f.counts is not None and f.counts.shape == (2, 2)
    np.testing.assert_array_equal(f.counts, counts)
    assert f.request_id == 42
    assert_read_only_view(f.counts)


def test_empty_push_round_trip_keeps_dim() -> None:
    f = codec.decode(
        op_encoders.encode_push("fm_v", keys_of(), np.zeros((0, 8), dtype=np.float32)),
    )
    assert f.count == 0 and f.dim == 8
    assert f.keys is not None and f.keys.shape == (0,)
    assert f.values is not None and f.values.shape == (0, 8)


def test_weights_reply_round_trip() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    f = codec.decode(op_encoders.encode_weights("fm_v", w, version=2**40 + 3), expect_op=Op.WEIGHTS)
    assert (f.op, f.count, f.dim, f.version) == (Op.WEIGHTS, 3, 4, 2**40 + 3)
    assert f.keys is None and f.counts is None
    np.testing.assert_array_equal(f.values, w)
    assert_read_only_view(f.values)


def test_empty_weights_reply_keeps_dim() -> None:
    f = codec.decode(op_encoders.encode_weights("fm_v", np.zeros((0, 4), np.float32), version=1))
    assert f.values is not None and f.values.shape == (0, 4)


def test_ack_round_trip() -> None:
    f = codec.decode(op_encoders.encode_ack("lr", applied=2**32 - 1, version=9), expect_op=Op.ACK)
    assert f == Frame(op=Op.ACK, table="lr", count=2**32 - 1, dim=0, keys=None, values=None, version=9)


def test_big_batch_round_trip() -> None:
    rng = np.random.default_rng(1)
    n, dim = 100_000, 4
    keys = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    counts = rng.integers(0, 5, size=(n, 2)).astype(np.float32)
    buf = op_encoders.encode_push("big", keys, grads, counts=counts)
    assert len(buf) == HEADER_SIZE + 8 + 8 * n + 4 * n * dim + 8 * n
    f = codec.decode(buf)
    np.testing.assert_array_equal(f.keys, keys)
    np.testing.assert_array_equal(f.values, grads)
    np.testing.assert_array_equal(f.counts, counts)


def test_big_endian_input_is_converted() -> None:
    keys = np.array([1, 2**56 + 3], dtype=">u8")
    grads = np.array([[1.5], [-2.0]], dtype=">f4")
    f = codec.decode(op_encoders.encode_push("lr", keys, grads))
    np.testing.assert_array_equal(f.keys, keys.astype(np.uint64))
    np.testing.assert_array_equal(f.values, grads.astype(np.float32))


def test_unicode_table_name_and_longest_name_round_trip() -> None:
    assert codec.decode(op_encoders.encode_pull("täble", keys_of(1))).table == "täble"
    longest = "n" * MAX_NAME
    assert codec.decode(op_encoders.encode_pull(longest, keys_of(1))).table == longest


def test_decode_accepts_memoryview_and_bytearray() -> None:
    buf = op_encoders.encode_pull("lr", keys_of(9, 8))
    for b in (memoryview(buf), bytearray(buf)):
        np.testing.assert_array_equal(codec.decode(b).keys, keys_of(9, 8))


def test_encode_rejects_a_name_over_the_limit() -> None:
    with pytest.raises(FrameError, match="longer than 255"):
        op_encoders.encode_pull("n" * (MAX_NAME + 1), keys_of(1))


# -- malformed frames ----------------------------------------------------------


def pull_frame() -> bytes:
    return op_encoders.encode_pull("lr", keys_of(1, 2, 3))


def push_frame(counts: bool = False) -> bytes:
    return op_encoders.encode_push(
        "lr",
        keys_of(1, 2, 3),
        np.ones((3, 2), dtype=np.float32),
        counts=np.ones((3, 2), dtype=np.float32) if counts else None,
    )


def expect_frame_error(buf: bytes, match: str, expect_op: int | None = None) -> FrameError:
    with pytest.raises(FrameError, match=match) as info:
        codec.decode(buf, expect_op)
    err = info.value
    assert err.code == "bad_frame" and err.status == 400
    assert err.detail == str(err) and err.detail
    return err


@pytest.mark.parametrize("size", [0, 1, 4, HEADER_SIZE - 1])
def test_short_header(size: int) -> None:
    expect_frame_error(pull_frame()[:size], rf"frame of {size} bytes is shorter than the 48-byte")


def test_bad_magic() -> None:
    buf = b"HTTP" + pull_frame()[4:]
    expect_frame_error(buf, r"bad magic b'HTTP', expected b'CTPS'")


@pytest.mark.parametrize("version", [0, 3, 255])
def test_unsupported_version(version: int) -> None:
    buf = patch(pull_frame(), OFF_VERSION, "B", version)
    expect_frame_error(buf, rf"unsupported frame format version {version} \(this peer speaks 1, 2\)")


@pytest.mark.parametrize("op", [0, 9, 255])
def test_unknown_op(op: int) -> None:
    expect_frame_error(patch(pull_frame(), OFF_OP, "B", op), rf"unknown op {op}")


@pytest.mark.parametrize(
    ("frame", "expect_op", "got"),
    [
        (pull_frame(), Op.PUSH, Op.PULL),
        (push_frame(), Op.PULL, Op.PUSH),
        (op_encoders.encode_ack("lr", 1, 1), Op.WEIGHTS, Op.ACK),
    ],
)
def test_unexpected_op(frame: bytes, expect_op: int, got: int) -> None:
    expect_frame_error(frame, rf"expected op {expect_op}, got {got}", expect_op=expect_op)


@pytest.mark.parametrize("flags", [2, 8, 0x8000, 0xFFFF])
def test_unknown_flags(flags: int) -> None:
    expect_frame_error(patch(push_frame(), OFF_FLAGS, "H", flags), r"unknown flags 0x")


@pytest.mark.parametrize(
    "frame",
    [
        pull_frame(),
        op_encoders.encode_weights("lr", np.ones((3, 2), np.float32), 1),
        op_encoders.encode_ack("lr", 3, 1),
    ],
    ids=["pull", "weights", "ack"],
)
def test_counts_flag_on_a_non_push(frame: bytes) -> None:
    expect_frame_error(patch(frame, OFF_FLAGS, "H", FLAG_COUNTS), r"only a push carries counts")


@pytest.mark.parametrize("name_len", [0, MAX_NAME + 1, 0xFFFF])
def test_name_length_out_of_range(name_len: int) -> None:
    buf = patch(pull_frame(), OFF_NAME_LEN, "H", name_len)
    expect_frame_error(buf, rf"table name length {name_len} outside 1\.\.255")


def test_truncated_inside_name() -> None:
    buf = op_encoders.encode_pull("a_rather_long_table_name", keys_of())
    expect_frame_error(buf[: HEADER_SIZE + 5], r"truncated inside the table name")


def test_non_utf8_name() -> None:
    buf = bytearray(op_encoders.encode_pull("ab", keys_of(1)))
    buf[HEADER_SIZE : HEADER_SIZE + 2] = b"\xff\xfe"
    expect_frame_error(bytes(buf), r"table name is not UTF-8")


@pytest.mark.parametrize(
    ("frame", "cut", "label"),
    [
        (pull_frame(), 8, "truncated keys"),
        (pull_frame(), 1, "one byte short"),
        (push_frame(), 4, "truncated values"),
        (push_frame(counts=True), 8, "truncated counts"),
        (op_encoders.encode_weights("lr", np.ones((3, 2), np.float32), 1), 4, "truncated weights"),
    ],
)
def test_truncated_arrays(frame: bytes, cut: int, label: str) -> None:
    expected = len(frame)
    expect_frame_error(
        frame[:-cut], rf"frame is {expected - cut} bytes but its header \(n=3, dim=\d\) implies {expected}"
    )


@pytest.mark.parametrize("extra", [1, 8, 100])
def test_trailing_bytes(extra: int) -> None:
    frame = push_frame()
    expect_frame_error(frame + b"\0" * extra, rf"frame is {len(frame) + extra} bytes but .* implies {len(frame)}")


def test_count_larger_than_the_body() -> None:
    buf = patch(pull_frame(), OFF_N, "I", 4)
    expect_frame_error(buf, r"header \(n=4, dim=0\) implies")


def test_counts_flag_set_but_counts_missing() -> None:
    buf = patch(push_frame(counts=False), OFF_FLAGS, "H", FLAG_COUNTS)
    expect_frame_error(buf, r"but its header \(n=3, dim=2\) implies")


@pytest.mark.parametrize(
    "frame",
    [push_frame(), op_encoders.encode_weights("lr", np.ones((3, 2), np.float32), 1)],
    ids=["push", "weights"],
)
def test_dim_zero_with_values(frame: bytes) -> None:
    expect_frame_error(patch(frame, OFF_DIM, "I", 0), r"a frame with values needs dim >= 1")


@pytest.mark.parametrize(
    ("frame", "op"),
    [(pull_frame(), Op.PULL), (op_encoders.encode_ack("lr", 3, 1), Op.ACK)],
    ids=["pull", "ack"],
)
def test_dim_nonzero_without_values(frame: bytes, op: int) -> None:
    expect_frame_error(patch(frame, OFF_DIM, "I", 1), rf"op {op} carries no values but dim is 1")


# -- push_pull frames (ops 5 and 6) ---------------------------------------------------

# The format-1 header as it was before push_pull: bytes 42..47 reserved.
_V1_HEADER = struct.Struct("<4sBBHIIdQQH6x")


def test_earlier_frames_are_byte_identical_to_the_format_before_push_pull() -> None:
    keys = keys_of(1, 2**64 - 1)
    grads = np.array([[0.5], [-2.0]], np.float32)
    counts = np.array([[1, 0], [2, 1]], np.float32)
    old_push = (
        _V1_HEADER.pack(b"CTPS", 1, Op.PUSH, FLAG_COUNTS, 2, 1, 1.5e9, 0, 77, 2)
        + b"lr"
        + b"\0" * 6
        + keys.astype("<u8").tobytes()
        + grads.astype("<f4").tobytes()
        + counts.astype("<f4").tobytes()
    )
    assert op_encoders.encode_push("lr", keys, grads, counts=counts, event_time=1.5e9, request_id=77) == old_push
    old_ack = _V1_HEADER.pack(b"CTPS", 1, Op.ACK, 0, 5, 0, 0.0, 3, 0, 2) + b"lr" + b"\0" * 6
    assert op_encoders.encode_ack("lr", 5, 3) == old_ack
    f = codec.decode(old_push, Op.PUSH)
    assert f.pull_keys is None and f.applied == 0 and f.request_id == 77


def push_pull_frame(n: int = 3, dim: int = 2, m: int = 4, counts: bool = False, request_id: int = 9) -> bytes:
    rng = np.random.default_rng(n * 100 + dim * 10 + m)
    return op_encoders.encode_push_pull(
        "fm",
        rng.integers(0, U64_MAX, n, dtype=np.uint64, endpoint=True),
        rng.standard_normal((n, dim)).astype(np.float32),
        rng.integers(0, U64_MAX, m, dtype=np.uint64, endpoint=True),
        counts=rng.integers(0, 4, (n, 2)).astype(np.float32) if counts else None,
        event_time=1.7e9,
        request_id=request_id,
    )


@pytest.mark.parametrize("with_counts", [False, True])
def test_push_pull_request_round_trip(with_counts: bool) -> None:
    keys = keys_of(0, U64_MAX, 5)
    grads = np.array([[0.5, -1.0, 3.0], [2.0, 3.0, 1e-30], [-0.25, 0.0, 7.0]], np.float32)
    counts = np.array([[1, 0], [3, 2], [0, 0]], np.float32) if with_counts else None
    pull = keys_of(U64_MAX, 8, 0, 5, 5)
    buf = op_encoders.encode_push_pull(
        "fm_v", keys, grads, pull, counts=counts, event_time=1.7e9 + 0.5, request_id=U64_MAX
    )
    # header, "fm_v" padded to 8, push keys, pull keys, grads, counts
    assert len(buf) == HEADER_SIZE + 8 + 8 * 3 + 8 * 5 + 4 * 9 + (8 * 3 if with_counts else 0)
    assert struct.unpack_from("<I", buf, OFF_M)[0] == 5
    f = codec.decode(buf, expect_op=Op.PUSH_PULL)
    assert (f.op, f.table, f.count, f.dim) == (Op.PUSH_PULL, "fm_v", 3, 3)
    assert (f.event_time, f.request_id, f.applied) == (1.7e9 + 0.5, U64_MAX, 0)
    np.testing.assert_array_equal(f.keys, keys)
    np.testing.assert_array_equal(f.pull_keys, pull)
    np.testing.assert_array_equal(f.values, grads)
    if with_counts:
        np.testing.assert_array_equal(f.counts, counts)
        assert_read_only_view(f.counts)
    else:
        assert f.counts is None
    for a in (f.keys, f.pull_keys, f.values):
        assert_read_only_view(a)


@pytest.mark.parametrize(("n", "dim", "m"), [(1, 1, 1), (3, 1, 2), (5, 3, 7), (1, 1, 0), (0, 1, 3)])
def test_push_pull_key_sections_are_8_aligned_whatever_n_dim(n: int, dim: int, m: int) -> None:
    # n·dim odd would leave a uint64 section after the float32 gradients at 4 mod 8.
    f = codec.decode(push_pull_frame(n, dim, m, counts=True))
    assert f.keys is not None and f.pull_keys is not None and f.values is not None
    assert (f.count, f.dim, f.pull_keys.size) == (n, dim, m)
    for a in (f.keys, f.pull_keys, f.values, f.counts):
        assert a is not None and a.flags.aligned


def test_push_pull_with_an_empty_push_or_pull() -> None:
    only_pull = codec.decode(op_encoders.encode_push_pull("lr", keys_of(), np.zeros((0, 1), np.float32), keys_of(4, 5)))
    assert only_pull.count == 0 and only_pull.dim == 1
    assert only_pull.keys is not None and only_pull.keys.shape == (0,)
    np.testing.assert_array_equal(only_pull.pull_keys, keys_of(4, 5))
    # An empty push may carry dim 0 (a caller with nothing to push).
    dimless = codec.decode(op_encoders.encode_push_pull("lr", keys_of(), np.zeros(0, np.float32), keys_of(4)))
    assert dimless.count == 0 and dimless.values is not None and dimless.values.shape[0] == 0
    only_push = codec.decode(op_encoders.encode_push_pull("lr", keys_of(4, 5), np.ones((2, 1), np.float32), keys_of()))
    assert only_push.count == 2
    assert only_push.pull_keys is not None and only_push.pull_keys.shape == (0,)


def test_a_push_pull_of_the_pushed_keys_sends_them_once() -> None:
    keys = keys_of(3, U64_MAX, 9)
    grads = np.array([[0.5], [-1.0], [2.0]], np.float32)
    buf = op_encoders.encode_push_pull("lr", keys, grads, keys, counts=np.ones((3, 2), np.float32))
    assert len(buf) == len(
        op_encoders.encode_push_pull("lr", keys, grads, keys_of(), counts=np.ones((3, 2), np.float32))
    )
    flags, m = struct.unpack_from("<H", buf, 6)[0], struct.unpack_from("<I", buf, OFF_M)[0]
    assert (flags, m) == (codec.FLAG_COUNTS | codec.FLAG_PULL_PUSHED, 0)
    f = codec.decode(buf, expect_op=Op.PUSH_PULL)
    np.testing.assert_array_equal(f.pull_keys, keys)
    assert f.pull_keys is f.keys
    # An equal copy is sent as keys (only the same array is recognised).
    copy = codec.decode(op_encoders.encode_push_pull("lr", keys, grads, keys.copy()))
    assert struct.unpack_from("<I", op_encoders.encode_push_pull("lr", keys, grads, keys.copy()), OFF_M)[0] == 3
    np.testing.assert_array_equal(copy.pull_keys, keys)
    # The flag with pull keys as well, or on another op, is refused.
    both = bytearray(op_encoders.encode_push_pull("lr", keys, grads, keys_of(1)))
    struct.pack_into("<H", both, 6, codec.FLAG_PULL_PUSHED)
    with pytest.raises(FrameError, match="push_pull request without pull keys"):
        codec.decode(bytes(both))
    push = bytearray(op_encoders.encode_push("lr", keys, grads))
    struct.pack_into("<H", push, 6, codec.FLAG_PULL_PUSHED)
    with pytest.raises(FrameError, match="push_pull request without pull keys"):
        codec.decode(bytes(push))


def test_push_pull_reply_round_trip() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    buf = op_encoders.encode_push_pull_reply("fm_v", applied=2**32 - 1, weights=w, version=2**40 + 3)
    f = codec.decode(buf, expect_op=Op.PUSH_PULL_REPLY)
    assert (f.op, f.count, f.dim, f.version, f.applied) == (Op.PUSH_PULL_REPLY, 3, 4, 2**40 + 3, 2**32 - 1)
    assert f.keys is None and f.pull_keys is None and f.counts is None and f.present is None
    np.testing.assert_array_equal(f.values, w)
    assert_read_only_view(f.values)
    empty = codec.decode(op_encoders.encode_push_pull_reply("fm_v", 7, np.zeros((0, 4), np.float32), 1))
    assert empty.values is not None and empty.values.shape == (0, 4) and empty.applied == 7


def test_encode_push_pull_refuses_disagreeing_push_sections() -> None:
    with pytest.raises(FrameError, match="push section of 3 keys, 2 gradient rows"):
        op_encoders.encode_push_pull("lr", keys_of(1, 2, 3), np.ones((2, 1), np.float32), keys_of())
    with pytest.raises(FrameError, match="1 rows of counts"):
        op_encoders.encode_push_pull(
            "lr", keys_of(1, 2), np.ones((2, 1), np.float32), keys_of(), counts=np.ones((1, 2), np.float32)
        )


def push_pull_reply_frame() -> bytes:
    return op_encoders.encode_push_pull_reply("lr", 3, np.ones((4, 2), np.float32), 1)


@pytest.mark.parametrize(
    ("frame", "expect_op", "got"),
    [
        (push_pull_frame(), Op.PUSH, Op.PUSH_PULL),
        (push_frame(), Op.PUSH_PULL, Op.PUSH),
        (pull_frame(), Op.PUSH_PULL, Op.PULL),
        (push_pull_reply_frame(), Op.WEIGHTS, Op.PUSH_PULL_REPLY),
        (op_encoders.encode_weights("lr", np.ones((3, 2), np.float32), 1), Op.PUSH_PULL_REPLY, Op.WEIGHTS),
    ],
)
def test_push_pull_unexpected_op(frame: bytes, expect_op: int, got: int) -> None:
    expect_frame_error(frame, rf"expected op {expect_op}, got {got}", expect_op=expect_op)


@pytest.mark.parametrize(
    "frame",
    [
        pull_frame(),
        push_frame(),
        op_encoders.encode_weights("lr", np.ones((3, 2), np.float32), 1),
        op_encoders.encode_ack("lr", 3, 1),
    ],
    ids=["pull", "push", "weights", "ack"],
)
def test_second_count_on_an_earlier_op(frame: bytes) -> None:
    # Bytes 44..47 were reserved: an earlier op with them set is refused, not read.
    op = frame[OFF_OP]
    expect_frame_error(patch(frame, OFF_M, "I", 2), rf"op {op} carries no second count but bytes 44..47 hold 2")


@pytest.mark.parametrize(("cut", "counts"), [(1, False), (4, False), (8, False), (8, True), (100, True)])
def test_push_pull_truncated(cut: int, counts: bool) -> None:
    frame = push_pull_frame(counts=counts)
    expected = len(frame)
    expect_frame_error(
        frame[:-cut],
        rf"frame is {expected - cut} bytes but its header \(n=3, dim=2, m=4\) implies {expected}",
    )


@pytest.mark.parametrize("extra", [1, 8, 32])
def test_push_pull_trailing_bytes(extra: int) -> None:
    frame = push_pull_frame()
    expect_frame_error(frame + b"\0" * extra, rf"frame is {len(frame) + extra} bytes but .*m=4\) implies {len(frame)}")


@pytest.mark.parametrize(("m", "label"), [(3, "fewer"), (5, "more"), (2**32 - 1, "huge")])
def test_push_pull_pull_count_disagrees_with_the_body(m: int, label: str) -> None:
    expect_frame_error(patch(push_pull_frame(), OFF_M, "I", m), rf"header \(n=3, dim=2, m={m}\) implies")


@pytest.mark.parametrize("n", [2, 4, 0])
def test_push_pull_push_count_disagrees_with_the_body(n: int) -> None:
    expect_frame_error(patch(push_pull_frame(), OFF_N, "I", n), rf"header \(n={n}, dim=2, m=4\) implies")


def test_push_pull_dim_disagrees_with_the_body() -> None:
    expect_frame_error(patch(push_pull_frame(), OFF_DIM, "I", 3), r"header \(n=3, dim=3, m=4\) implies")
    expect_frame_error(patch(push_pull_frame(), OFF_DIM, "I", 0), r"a frame with values needs dim >= 1")


def test_push_pull_counts_flag_set_but_counts_missing() -> None:
    buf = patch(push_pull_frame(counts=False), OFF_FLAGS, "H", FLAG_COUNTS)
    expect_frame_error(buf, r"but its header \(n=3, dim=2, m=4\) implies")


@pytest.mark.parametrize("flags", [FLAG_PRESENCE, FLAG_PRESENCE | FLAG_COUNTS])
def test_push_pull_refuses_presence(flags: int) -> None:
    expect_frame_error(patch(push_pull_frame(), OFF_FLAGS, "H", flags), r"only pulls carry presence")
    expect_frame_error(patch(push_pull_reply_frame(), OFF_FLAGS, "H", FLAG_PRESENCE), r"only pulls carry presence")


def test_push_pull_reply_refuses_counts_and_unknown_flags() -> None:
    expect_frame_error(patch(push_pull_reply_frame(), OFF_FLAGS, "H", FLAG_COUNTS), r"only a push carries counts")
    expect_frame_error(patch(push_pull_frame(), OFF_FLAGS, "H", 8), r"unknown flags 0x8")
    # Pulling the pushed keys while also carrying pull keys: refused.
    expect_frame_error(patch(push_pull_frame(), OFF_FLAGS, "H", 4), r"without pull keys")


def test_push_pull_reply_truncated_or_padded() -> None:
    frame = push_pull_reply_frame()
    expect_frame_error(frame[:-4], r"header \(n=4, dim=2\) implies")
    expect_frame_error(frame + b"\0" * 8, r"header \(n=4, dim=2\) implies")


@pytest.mark.parametrize("version", [0, 3])
def test_push_pull_wrong_format_version(version: int) -> None:
    expect_frame_error(
        patch(push_pull_frame(), OFF_VERSION, "B", version), rf"unsupported frame format version {version}"
    )
