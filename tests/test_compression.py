"""Compressed frames: value types, narrowed counts, key sets, error feedback.

Round trips of every value type and count type with their edge cases; the
format 2 frame and its refusals; a shard's key sets; and a client over real
shard servers pushing in float16 and int8 with key sets, against the same
pushes in float32.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ps_core.errors import FrameError, FrameVersionError, InvalidValuesError, KeySetExpiredError
from ps_core.net import codec, op_encoders
from ps_core.net.client import PSClient
from ps_core.net.codec import FLAG_KEYS_REF, FLAG_REMEMBER, Op
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.frame_handler import handle_frame
from ps_core.net.quantize import BLOCK, F16_MAX, compact_counts, dequantize, quantize, read_counts
from ps_core.net.wire import ErrorFeedback, WireFormat
from ps_core.shard import Shard
from ps_core.shard.key_sets import KeySets
from ps_core.store.table_config import TableConfig

F16, INT8 = 1, 2
LR = TableConfig("lr", dim=1, optimizer={"name": "sgd", "lr": 0.1})
EMB = TableConfig("emb", dim=4, optimizer={"name": "sgd", "lr": 0.1})


def roundtrip(x: np.ndarray, vtype: int, rounding: Any = "nearest", seed: int = 0) -> tuple[np.ndarray, int]:
    q = quantize(x, vtype, rounding, np.random.default_rng(seed))
    assert len(q.data) % 8 == 0
    return dequantize(memoryview(q.data), 0, vtype, x.size).reshape(x.shape), q.clipped


# -- value types --------------------------------------------------------------


@pytest.mark.parametrize("vtype", [0, F16, INT8])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_every_value_type_round_trips_within_its_step(vtype: int, n: int) -> None:
    x = np.random.default_rng(n).normal(0, 0.05, n).astype(np.float32)
    for rounding in ("nearest", "stochastic"):
        got, clipped = roundtrip(x, vtype, rounding)
        assert got.shape == x.shape and got.dtype == np.float32 and clipped == 0
        if vtype == 0:
            np.testing.assert_array_equal(got, x)
        elif vtype == F16:
            # one float16 step at most (half of one when rounding to nearest)
            step = np.abs(np.spacing(x.astype(np.float16)).astype(np.float32))
            assert (np.abs(got - x) <= step * (0.5 if rounding == "nearest" else 1.0) + 1e-12).all()
        else:
            blocks = np.zeros(((n + BLOCK - 1) // BLOCK) * BLOCK, np.float32)
            blocks[:n] = np.abs(x)
            scale = np.repeat(blocks.reshape(-1, BLOCK).max(axis=1) / 127, BLOCK)[:n]
            assert (np.abs(got - x) <= scale * (0.5 if rounding == "nearest" else 1.0) * (1 + 1e-5)).all()


@pytest.mark.parametrize("vtype", [F16, INT8])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(vtype: int) -> None:
    # A value a third of the way between two float16 neighbours (and, for
    # int8, a block whose largest value makes it fall between two codes).
    lo = np.float16(0.1)
    x16 = np.float32(lo) + np.float32(np.spacing(lo)) / 3
    x = np.full(BLOCK * 400, x16, np.float32)
    if vtype == INT8:
        x[::BLOCK] = 1.0  # scale 1/127: x is ~12.7 codes
    rest = np.ones(x.size, bool)
    if vtype == INT8:
        rest[::BLOCK] = False
    mean_s = roundtrip(x, vtype, "stochastic", seed=3)[0][rest].mean(dtype=np.float64)
    mean_n = roundtrip(x, vtype, "nearest")[0][rest].mean(dtype=np.float64)
    step = float(np.spacing(lo)) if vtype == F16 else 1 / 127
    assert abs(mean_s - float(x16)) < 0.03 * step
    assert abs(mean_n - float(x16)) > 0.2 * step


def test_edge_cases_of_values() -> None:
    # all values equal: one block, every code 127
    same = np.full(200, -0.25, np.float32)
    np.testing.assert_allclose(roundtrip(same, INT8)[0], same, rtol=1e-6)
    # a block of zeros reads back zeros, not NaN
    zeros = np.zeros(BLOCK + 3, np.float32)
    np.testing.assert_array_equal(roundtrip(zeros, INT8, "stochastic")[0], zeros)
    # float16 overflow: clipped to ±65504 and counted
    big = np.array([1e6, -7e4, 65504, 1.0], np.float32)
    got, clipped = roundtrip(big, F16, "stochastic")
    assert clipped == 2
    np.testing.assert_array_equal(got, [F16_MAX, -F16_MAX, F16_MAX, 1.0])
    # NaN and infinity refused, in every type, before anything is encoded
    for bad in (np.nan, np.inf, -np.inf):
        for vtype in (0, F16, INT8):
            with pytest.raises(InvalidValuesError, match="NaN or infinite"):
                quantize(np.array([1.0, bad], np.float32), vtype, "stochastic")


def test_decoding_refuses_what_no_writer_writes() -> None:
    nan16 = np.array([np.nan, 1], "<f2").tobytes() + b"\0" * 4
    with pytest.raises(FrameError, match="NaN or infinity"):
        dequantize(memoryview(nan16), 0, F16, 2)
    q = bytearray(quantize(np.ones(3, np.float32), INT8, "nearest").data)
    q[8] = 0x80  # the first code: -128
    with pytest.raises(FrameError, match="-128"):
        dequantize(memoryview(bytes(q)), 0, INT8, 3)
    with pytest.raises(FrameError, match="unknown value type"):
        dequantize(memoryview(b"\0" * 8), 0, 7, 1)


# -- counts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top", "ctype", "width"),
    [(0, 1, 1), (255, 1, 1), (256, 2, 2), (65535, 2, 2), (65536, 3, 4), (2**32 - 256, 3, 4), (2**32, 0, 4)],
)
def test_counts_take_the_narrowest_exact_type(top: int, ctype: int, width: int) -> None:
    c = np.array([[1, 0], [top, 3], [7, 7]], np.float32)
    code, raw = compact_counts(c)
    assert code == ctype and len(raw) == ((6 * width + 7) // 8) * 8
    np.testing.assert_array_equal(read_counts(memoryview(raw), 0, code, 3), c)


@pytest.mark.parametrize("counts", [[[0.5, 0]], [[-1, 0]], [[1, 0.25]]])
def test_fractional_or_negative_counts_stay_float32(counts: list[list[float]]) -> None:
    c = np.array(counts, np.float32)
    code, raw = compact_counts(c)
    assert code == 0
    np.testing.assert_array_equal(read_counts(memoryview(raw), 0, 0, 1), c)


def test_a_few_large_counts_are_escaped_not_widening_every_row() -> None:
    c = np.ones((64, 2), np.float32)
    c[0] = [256, 3]  # the bias key of a 256-event mini-batch
    c[9] = [7e5, 2**33]
    code, raw = compact_counts(c)
    assert code == 4 and len(raw) == 8 + 128 + 8 + 16  # k, 64 u8 pairs, 2 rows, their f32 pairs
    np.testing.assert_array_equal(read_counts(memoryview(raw), 0, code, 64), c)
    buf = op_encoders.encode_push(
        "lr", np.arange(64, dtype=np.uint64), np.zeros(64, np.float32), counts=c, compact=True
    )
    np.testing.assert_array_equal(codec.decode(buf).counts, c)
    with pytest.raises(FrameError, match="implies"):
        codec.decode(buf[:-8])
    bad = bytearray(buf)
    struct.pack_into("<I", bad, len(buf) - len(raw), 65)  # an overflow count beyond the rows
    with pytest.raises(FrameError, match="overflow list of 65 rows"):
        codec.decode(bytes(bad))
    many = np.full((8, 2), 300, np.float32)  # most rows large: u16 is smaller
    assert compact_counts(many)[0] == 2


# Mostly small whole counts (a mini-batch's), with any float32 among them.
_COUNT_VALUES = st.one_of(
    st.integers(0, 300).map(float),
    st.sampled_from([255.0, 256.0, 2.0**32, -1.0, 0.5, float("nan"), float("inf")]),
    st.floats(width=32),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(0, 40), st.just(2)), elements=_COUNT_VALUES))
def test_any_counts_round_trip_exactly_or_are_refused(c: np.ndarray) -> None:
    if not np.isfinite(c).all():
        with pytest.raises(InvalidValuesError):
            compact_counts(c)
        return
    code, raw = compact_counts(c)
    assert len(raw) % 8 == 0
    np.testing.assert_array_equal(read_counts(memoryview(raw), 0, code, c.shape[0]), c)


def test_empty_counts() -> None:
    code, raw = compact_counts(np.zeros((0, 2), np.float32))
    assert raw == b"" and read_counts(memoryview(raw), 0, code, 0).shape == (0, 2)


# -- the format 2 frame ---------------------------------------------------------

KEYS = np.array([5, 0, 2**64 - 1, 9], np.uint64)
GRADS = np.array([[0.5, -1, 2, 0], [1e-3, 0, 0, 3], [0, 0, 0, 0], [-2, 1, 1, 1]], np.float32)
COUNTS = np.array([[1, 0], [3, 1], [1, 1], [200, 9]], np.float32)


@pytest.mark.parametrize("vtype", [0, F16, INT8])
@pytest.mark.parametrize("compact", [False, True])
def test_push_frame_round_trip(vtype: int, compact: bool) -> None:
    grads = quantize(GRADS, vtype, "nearest") if vtype else GRADS
    buf = op_encoders.encode_push(
        "emb", KEYS, grads, counts=COUNTS, dim=4, request_id=7, base_clock=3, event_time=1.5, compact=compact
    )
    f = codec.decode(buf, Op.PUSH)
    assert f.format_version == (2 if vtype or compact else 1)
    assert f.value_type == vtype and (f.count, f.dim, f.request_id, f.clock, f.event_time) == (4, 4, 7, 3, 1.5)
    np.testing.assert_array_equal(f.keys, KEYS)
    np.testing.assert_array_equal(f.counts, COUNTS)
    assert f.values is not None
    tol = {0: 0, F16: 1e-3, INT8: 2 / 127}[vtype]
    np.testing.assert_allclose(f.values, GRADS, atol=tol * 2, rtol=tol)
    if compact:
        assert buf[43] == 1  # u8 counts: 2 bytes a key, not 8


def test_a_key_set_push_carries_eight_bytes_of_keys() -> None:
    with_keys = op_encoders.encode_push("lr", KEYS, GRADS[:, :1], request_id=1)
    named = op_encoders.encode_push("lr", KEYS, GRADS[:, :1], request_id=1, keys_ref=99)
    assert len(with_keys) - len(named) == 8 * KEYS.size - 8
    f = codec.decode(named)
    assert f.keys is None and f.keys_ref == 99 and f.count == 4 and f.format_version == 2


def test_pull_asking_float16_and_remembering() -> None:
    f = codec.decode(op_encoders.encode_pull("lr", KEYS, reply_vtype=F16, remember=42))
    assert (f.reply_value_type, f.remember, f.request_id, f.format_version) == (F16, True, 42, 2)
    reply = op_encoders.encode_weights("lr", quantize(GRADS, F16, "nearest"), 3, clock=5, rows=4, dim=4)
    w = codec.decode(reply, Op.WEIGHTS)
    assert (w.version, w.clock, w.value_type) == (3, 5, F16)
    np.testing.assert_allclose(w.values, GRADS, rtol=1e-3, atol=1e-6)
    assert len(reply) < len(op_encoders.encode_weights("lr", GRADS, 3))


def test_push_pull_naming_its_set_and_pulling_it() -> None:
    buf = op_encoders.encode_push_pull(
        "lr", KEYS, quantize(GRADS[:, :1], INT8, "nearest"), KEYS, dim=1, request_id=8, keys_ref=5, compact=True
    )
    f = codec.decode(buf, Op.PUSH_PULL)
    assert f.keys is None and f.pull_keys is None and f.pull_pushed and f.keys_ref == 5 and f.count == 4


@pytest.mark.parametrize(
    ("build", "match"),
    [
        # bytes 42..43 were reserved in format 1 and stay zero there
        (
            lambda: (
                bytearray(op_encoders.encode_pull("lr", KEYS))[:42] + b"\1" + op_encoders.encode_pull("lr", KEYS)[43:]
            ),
            "reserved",
        ),
        # the key-set flags are format 2's
        (lambda: _with_flags(op_encoders.encode_pull("lr", KEYS), FLAG_REMEMBER), "unknown flags 0x10 in a format 1"),
        # a weights reply is never int8, a pull never names a key set
        (
            lambda: _types(
                op_encoders.encode_weights("lr", quantize(GRADS[:, :1], F16, "nearest"), 1, rows=4, dim=1), 2
            ),
            "int8",
        ),
        (lambda: _with_flags(op_encoders.encode_pull("lr", KEYS, reply_vtype=F16), FLAG_KEYS_REF), "push's keys"),
        # remembering needs a request id to remember under
        (lambda: _zero_request_id(op_encoders.encode_pull("lr", KEYS, remember=3)), "request id"),
        (lambda: _types(op_encoders.encode_pull("lr", KEYS, reply_vtype=F16), 0x31), "unknown value type"),
        (lambda: op_encoders.encode_push("lr", KEYS, GRADS[:, :1], keys_ref=0) + b"", None),
    ],
)
def test_format_2_refusals(build: Any, match: str | None) -> None:
    buf = bytes(build())
    if match is None:
        codec.decode(buf)
        return
    with pytest.raises(FrameError, match=match):
        codec.decode(buf)


def test_encoding_refuses_a_remembered_pull_without_an_id() -> None:
    with pytest.raises(FrameError, match="request id"):
        codec.encode(Op.PULL, "lr", keys=KEYS, remember=True)


def _with_flags(buf: bytes, flags: int) -> bytes:
    b = bytearray(buf)
    struct.pack_into("<H", b, 6, struct.unpack_from("<H", b, 6)[0] | flags)
    return bytes(b)


def _types(buf: bytes, value: int) -> bytes:
    b = bytearray(buf)
    b[42] = value
    return bytes(b)


def _zero_request_id(buf: bytes) -> bytes:
    b = bytearray(buf)
    struct.pack_into("<Q", b, 32, 0)
    return bytes(b)


def test_a_format_1_reader_refuses_format_2_by_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "FORMAT_VERSIONS", (1,))
    with pytest.raises(FrameError, match=r"unsupported frame format version 2 \(this peer speaks 1\)"):
        codec.decode(op_encoders.encode_pull("lr", KEYS, reply_vtype=F16))
    codec.decode(op_encoders.encode_pull("lr", KEYS))  # format 1 frames still read


# -- key sets -------------------------------------------------------------------


def test_key_sets_are_taken_once_and_bounded() -> None:
    sets = KeySets(max_sets=2, max_keys=10, ttl_s=60)
    sets.remember(1, "lr", KEYS)
    np.testing.assert_array_equal(sets.take(1, "lr", 4), KEYS)
    with pytest.raises(KeySetExpiredError, match="key set 1 is not held"):
        sets.take(1, "lr", 4)
    sets.remember(2, "lr", KEYS)
    with pytest.raises(KeySetExpiredError, match="holds 4 keys of table 'lr'"):
        sets.take(2, "emb", 4)  # and it is gone now: a set is used once
    for i in range(3, 6):
        sets.remember(i, "lr", KEYS[:3])
    assert len(sets) == 2 and sets.keys_held == 6 and sets.dropped >= 1  # oldest dropped
    sets.remember(9, "lr", np.arange(11, dtype=np.uint64))  # larger than all the store
    assert 9 not in sets._sets
    old = KeySets(ttl_s=0.0)
    old.remember(1, "lr", KEYS)
    with pytest.raises(KeySetExpiredError):
        old.take(1, "lr", 4)
    assert old.stats()["expired"] == 1


def test_a_shard_applies_a_named_set_as_the_keys_and_refuses_a_gone_one() -> None:
    named, plain = Shard(tables=[LR]), Shard(tables=[LR])
    g = np.array([[0.5], [-1], [2], [0.25]], np.float32)
    handle_frame(named, op_encoders.encode_pull("lr", KEYS, remember=11))
    handle_frame(named, op_encoders.encode_push("lr", KEYS, g, request_id=12, keys_ref=11))
    handle_frame(plain, op_encoders.encode_push("lr", KEYS, g, request_id=12))
    np.testing.assert_array_equal(named.handle_pull("lr", KEYS)[0], plain.handle_pull("lr", KEYS)[0])
    before = named.handle_pull("lr", KEYS)[0].copy()
    with pytest.raises(KeySetExpiredError):
        handle_frame(named, op_encoders.encode_push("lr", KEYS, g, request_id=13, keys_ref=11))
    np.testing.assert_array_equal(named.handle_pull("lr", KEYS)[0], before)  # nothing applied
    assert named.stats()["wire"]["key_sets"]["expired"] == 1


@pytest.mark.parametrize(
    "keys",
    [np.array([42], np.uint64), np.array([7, 7, 7], np.uint64), np.zeros(0, np.uint64)],
    ids=["one", "equal", "empty"],
)
@pytest.mark.parametrize("vtype", [0, F16, INT8])
def test_a_named_set_of_one_equal_or_no_keys_applies_as_the_keys_do(keys: np.ndarray, vtype: int) -> None:
    named, plain = Shard(tables=[LR]), Shard(tables=[LR])
    g = np.linspace(-1, 1, keys.size, dtype=np.float32).reshape(-1, 1)
    grads = quantize(g, vtype, "nearest") if vtype else g
    c = np.ones((keys.size, 2), np.float32)
    handle_frame(named, op_encoders.encode_pull("lr", keys, remember=5))
    handle_frame(
        named, op_encoders.encode_push("lr", keys, grads, counts=c, request_id=6, keys_ref=5, dim=1, compact=True)
    )
    handle_frame(plain, op_encoders.encode_push("lr", keys, grads, counts=c, request_id=6, dim=1))
    probe = np.array([42, 7, 1], np.uint64)
    np.testing.assert_array_equal(named.handle_pull("lr", probe)[0], plain.handle_pull("lr", probe)[0])
    assert named.tables["lr"].shows.sum() == plain.tables["lr"].shows.sum() == keys.size


def test_error_feedback_carries_rounding_to_the_next_push() -> None:
    fb = ErrorFeedback(max_rows=100)
    keys = np.arange(BLOCK, dtype=np.uint64)
    g = np.full((BLOCK, 1), 0.3 / 127, np.float32)
    g[0] = 1.0  # scale 1/127: the others are 0.3 of a code and round to 0
    total = np.zeros(BLOCK, np.float64)
    for _ in range(50):
        q = fb.quantize(keys, g, INT8)
        total += dequantize(memoryview(q.data), 0, INT8, BLOCK)
    # what was sent sums to what was computed, less at most one code
    assert np.abs(total - 50 * g[:, 0]).max() <= 1 / 127 + 1e-6
    fb2 = ErrorFeedback(max_rows=10)
    fb2.quantize(np.arange(8, dtype=np.uint64), np.ones((8, 1), np.float32), F16)
    fb2.quantize(np.arange(8, 16, dtype=np.uint64), np.ones((8, 1), np.float32), F16)
    assert fb2.resets == 1 and fb2.index.size == 8


# -- a client over shard servers ---------------------------------------------------


@pytest.mark.parametrize("push", ["f16", "int8"])
@pytest.mark.parametrize("rounding", ["stochastic", "feedback"])
async def test_compressed_training_steps_track_float32(serve_shards: Any, push: str, rounding: str) -> None:
    """The same push_pull loop over 2 shard servers, float32 and compressed
    with key sets: the weights agree to the value type's precision, every
    push named its set, and the frames carried far fewer bytes."""
    rng = np.random.default_rng(5)
    pool = rng.integers(1, 2**63, 3000, dtype=np.uint64)
    batches = [np.unique(rng.choice(pool, 600)) for _ in range(12)]
    grads = [rng.normal(0, 0.02, (b.size, 4)).astype(np.float32) for b in batches]
    counts = [np.stack([np.ones(b.size), rng.integers(0, 2, b.size)], axis=1).astype(np.float32) for b in batches]
    results = {}
    for name, wire in (
        ("f32", WireFormat()),
        ("q", WireFormat(push=push, pull="f16", key_sets=True, compact_counts=True, rounding=rounding)),
    ):  # type: ignore[arg-type]
        shards, urls = await serve_shards(2, (EMB,), rpc=True)
        client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=2.0), wire=wire)
        try:
            routed = [client.route(b) for b in batches]
            await client.pull("emb", routed[0])
            for i in range(len(batches)):
                nxt = routed[i + 1] if i + 1 < len(batches) else client.route(np.zeros(0, np.uint64))
                await client.push_pull("emb", routed[i], grads[i], pull_keys=nxt, counts=counts[i])
            stats = client.wire_stats()  # the training steps' bytes
            results[name] = (await client.pull("emb", pool), stats, shards)
        finally:
            await client.close()
    (w32, s32, _), (wq, sq, shards) = results["f32"], results["q"]
    np.testing.assert_allclose(wq, w32, atol=2e-3 if push == "int8" else 5e-4)
    assert sq.key_set_pushes == 2 * len(batches) and sq.key_set_misses == 0
    # per key of dim 4: 56 bytes in float32, 26 in float16 (25 in int8) with key sets
    assert sq.bytes_sent + sq.bytes_received < 0.5 * (s32.bytes_sent + s32.bytes_received)
    assert sum(s.key_sets.used for s in shards) == 2 * len(batches)


async def test_a_push_whose_set_expired_is_sent_again_with_its_keys(serve_shards: Any) -> None:
    shards, urls = await serve_shards(1, (LR,), rpc=True)
    client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=2.0), wire=WireFormat(key_sets=True))
    try:
        r = client.route(KEYS)
        await client.pull("lr", r)
        shards[0].key_sets = KeySets()  # as after a restart: the set is gone
        assert await client.push("lr", r, np.ones(4, np.float32)) == 4
        stats = client.wire_stats()
        assert (stats.key_set_pushes, stats.key_set_misses) == (1, 1)
        assert shards[0].tables["lr"].pushes == 1  # applied once
    finally:
        await client.close()


@pytest.mark.parametrize("rpc", [True, False])
async def test_a_shard_reading_format_1_only_refuses_a_compressed_client_clearly(
    serve_shards: Any, monkeypatch: pytest.MonkeyPatch, rpc: bool
) -> None:
    _, urls = await serve_shards(1, (LR,), rpc=rpc)
    monkeypatch.setattr(codec, "FORMAT_VERSIONS", (1,))  # the shard's reader, as before format 2
    client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=1.0), wire=WireFormat(pull="f16"), rpc=rpc)
    try:
        with pytest.raises(FrameVersionError, match="unsupported frame format version 2") as info:
            await client.pull("lr", KEYS)
        # one line saying what to change, and a worker's exit code for it
        assert "--no-key-sets" in info.value.detail and info.value.exit_code == 1
    finally:
        await client.close()
