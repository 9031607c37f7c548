"""The binary frame codec: round trips of every op, and every malformed frame.

Malformed frames are built by encoding a valid frame and patching bytes at the
header offsets documented in `ps_core.codec` (magic 0, version 4, op 5,
flags 6, n 8, dim 12, event_time 16, version 24, request_id 32, name length
40, table name 48).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ps_core import codec
from ps_core.codec import FLAG_COUNTS, FORMAT_VERSION, HEADER_SIZE, MAX_NAME, Frame, Op
from ps_core.errors import FrameError

U64_MAX = 2**64 - 1

# Header field offsets (see the codec docstring).
OFF_VERSION = 4
OFF_OP = 5
OFF_FLAGS = 6
OFF_N = 8
OFF_DIM = 12
OFF_NAME_LEN = 40


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
        buf = codec.encode_pull(name, keys_of(7))
        # header, name padded to 8, one uint64 key
        assert len(buf) == HEADER_SIZE + ((len(name) + 7) // 8) * 8 + 8
        assert buf[:4] == b"CTPS"
        assert buf[OFF_VERSION] == FORMAT_VERSION
        assert buf[OFF_OP] == Op.PULL


# -- round trips ---------------------------------------------------------------


def test_pull_request_round_trip_with_extreme_keys() -> None:
    keys = keys_of(0, 1, 12345, 2**63, U64_MAX, 0)
    f = codec.decode(codec.encode_pull("lr", keys))
    assert (f.op, f.table, f.count, f.dim) == (Op.PULL, "lr", 6, 0)
    assert f.values is None and f.counts is None
    assert f.keys is not None and f.keys.dtype == np.uint64
    np.testing.assert_array_equal(f.keys, keys)
    assert int(f.keys[4]) == U64_MAX and int(f.keys[0]) == 0
    assert_read_only_view(f.keys)


def test_empty_pull_request_round_trip() -> None:
    f = codec.decode(codec.encode_pull("lr", keys_of()), expect_op=Op.PULL)
    assert f.count == 0 and f.dim == 0
    assert f.keys is not None and f.keys.shape == (0,)


def test_push_request_round_trip_without_counts() -> None:
    keys = keys_of(0, U64_MAX, 5)
    grads = np.array([[0.5, -1.0], [2.0, 3.0], [-0.25, 1e-30]], dtype=np.float32)
    buf = codec.encode_push("fm_v", keys, grads, event_time=1.7e9 + 0.25, request_id=U64_MAX)
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
    buf = codec.encode_push("lr", keys, grads, counts=counts, request_id=42)
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
        codec.encode_push("fm_v", keys_of(), np.zeros((0, 8), dtype=np.float32)),
    )
    assert f.count == 0 and f.dim == 8
    assert f.keys is not None and f.keys.shape == (0,)
    assert f.values is not None and f.values.shape == (0, 8)


def test_weights_reply_round_trip() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    f = codec.decode(codec.encode_weights("fm_v", w, version=2**40 + 3), expect_op=Op.WEIGHTS)
    assert (f.op, f.count, f.dim, f.version) == (Op.WEIGHTS, 3, 4, 2**40 + 3)
    assert f.keys is None and f.counts is None
    np.testing.assert_array_equal(f.values, w)
    assert_read_only_view(f.values)


def test_empty_weights_reply_keeps_dim() -> None:
    f = codec.decode(codec.encode_weights("fm_v", np.zeros((0, 4), np.float32), version=1))
    assert f.values is not None and f.values.shape == (0, 4)


def test_ack_round_trip() -> None:
    f = codec.decode(codec.encode_ack("lr", applied=2**32 - 1, version=9), expect_op=Op.ACK)
    assert f == Frame(
        op=Op.ACK, table="lr", count=2**32 - 1, dim=0, keys=None, values=None, version=9
    )


def test_big_batch_round_trip() -> None:
    rng = np.random.default_rng(1)
    n, dim = 100_000, 4
    keys = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    counts = rng.integers(0, 5, size=(n, 2)).astype(np.float32)
    buf = codec.encode_push("big", keys, grads, counts=counts)
    assert len(buf) == HEADER_SIZE + 8 + 8 * n + 4 * n * dim + 8 * n
    f = codec.decode(buf)
    np.testing.assert_array_equal(f.keys, keys)
    np.testing.assert_array_equal(f.values, grads)
    np.testing.assert_array_equal(f.counts, counts)


def test_big_endian_input_is_converted() -> None:
    keys = np.array([1, 2**56 + 3], dtype=">u8")
    grads = np.array([[1.5], [-2.0]], dtype=">f4")
    f = codec.decode(codec.encode_push("lr", keys, grads))
    np.testing.assert_array_equal(f.keys, keys.astype(np.uint64))
    np.testing.assert_array_equal(f.values, grads.astype(np.float32))


def test_unicode_table_name_and_longest_name_round_trip() -> None:
    assert codec.decode(codec.encode_pull("täble", keys_of(1))).table == "täble"
    longest = "n" * MAX_NAME
    assert codec.decode(codec.encode_pull(longest, keys_of(1))).table == longest


def test_decode_accepts_memoryview_and_bytearray() -> None:
    buf = codec.encode_pull("lr", keys_of(9, 8))
    for b in (memoryview(buf), bytearray(buf)):
        np.testing.assert_array_equal(codec.decode(b).keys, keys_of(9, 8))


def test_encode_rejects_a_name_over_the_limit() -> None:
    with pytest.raises(FrameError, match="longer than 255"):
        codec.encode_pull("n" * (MAX_NAME + 1), keys_of(1))


# -- malformed frames ----------------------------------------------------------


def pull_frame() -> bytes:
    return codec.encode_pull("lr", keys_of(1, 2, 3))


def push_frame(counts: bool = False) -> bytes:
    return codec.encode_push(
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


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unsupported_version(version: int) -> None:
    buf = patch(pull_frame(), OFF_VERSION, "B", version)
    expect_frame_error(buf, rf"unsupported frame format version {version} .*speaks 1")


@pytest.mark.parametrize("op", [0, 5, 255])
def test_unknown_op(op: int) -> None:
    expect_frame_error(patch(pull_frame(), OFF_OP, "B", op), rf"unknown op {op}")


@pytest.mark.parametrize(
    ("frame", "expect_op", "got"),
    [
        (pull_frame(), Op.PUSH, Op.PULL),
        (push_frame(), Op.PULL, Op.PUSH),
        (codec.encode_ack("lr", 1, 1), Op.WEIGHTS, Op.ACK),
    ],
)
def test_unexpected_op(frame: bytes, expect_op: int, got: int) -> None:
    expect_frame_error(frame, rf"expected op {expect_op}, got {got}", expect_op=expect_op)


@pytest.mark.parametrize("flags", [2, 4, 0x8000, 0xFFFF])
def test_unknown_flags(flags: int) -> None:
    expect_frame_error(patch(push_frame(), OFF_FLAGS, "H", flags), r"unknown flags 0x")


@pytest.mark.parametrize(
    "frame",
    [pull_frame(), codec.encode_weights("lr", np.ones((3, 2), np.float32), 1), codec.encode_ack("lr", 3, 1)],
    ids=["pull", "weights", "ack"],
)
def test_counts_flag_on_a_non_push(frame: bytes) -> None:
    expect_frame_error(patch(frame, OFF_FLAGS, "H", FLAG_COUNTS), r"only a push carries counts")


@pytest.mark.parametrize("name_len", [0, MAX_NAME + 1, 0xFFFF])
def test_name_length_out_of_range(name_len: int) -> None:
    buf = patch(pull_frame(), OFF_NAME_LEN, "H", name_len)
    expect_frame_error(buf, rf"table name length {name_len} outside 1\.\.255")


def test_truncated_inside_name() -> None:
    buf = codec.encode_pull("a_rather_long_table_name", keys_of())
    expect_frame_error(buf[: HEADER_SIZE + 5], r"truncated inside the table name")


def test_non_utf8_name() -> None:
    buf = bytearray(codec.encode_pull("ab", keys_of(1)))
    buf[HEADER_SIZE : HEADER_SIZE + 2] = b"\xff\xfe"
    expect_frame_error(bytes(buf), r"table name is not UTF-8")


@pytest.mark.parametrize(
    ("frame", "cut", "label"),
    [
        (pull_frame(), 8, "truncated keys"),
        (pull_frame(), 1, "one byte short"),
        (push_frame(), 4, "truncated values"),
        (push_frame(counts=True), 8, "truncated counts"),
        (codec.encode_weights("lr", np.ones((3, 2), np.float32), 1), 4, "truncated weights"),
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
    [push_frame(), codec.encode_weights("lr", np.ones((3, 2), np.float32), 1)],
    ids=["push", "weights"],
)
def test_dim_zero_with_values(frame: bytes) -> None:
    expect_frame_error(patch(frame, OFF_DIM, "I", 0), r"a frame with values needs dim >= 1")


@pytest.mark.parametrize(
    ("frame", "op"),
    [(pull_frame(), Op.PULL), (codec.encode_ack("lr", 3, 1), Op.ACK)],
    ids=["pull", "ack"],
)
def test_dim_nonzero_without_values(frame: bytes, op: int) -> None:
    expect_frame_error(patch(frame, OFF_DIM, "I", 1), rf"op {op} carries no values but dim is 1")
