"""A replica's read-only table: sorted keys, weights in f32, f16 or int8.

Against a trainer's `SparseTable` fed the same rows: exact in f32, within
half a float16 step in f16, within its bucket's step in int8; deltas with
deletions, absent keys, and the int8 exponents across deltas.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_core.checkpoint.serving_files import block_int8
from ps_core.replica import ReadTable
from ps_core.store.block_int8 import NO_EXP, block_codes, block_exponents
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

LR = TableConfig("w", 1, {"name": "sgd"})
EMB = TableConfig("v", 4, {"name": "sgd"}, init_scale=0.05, seed=3)


def rows(rng: np.random.Generator, n: int, dim: int = 1) -> tuple[np.ndarray, np.ndarray]:
    keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False))
    return keys, rng.normal(0, 0.3, (keys.size, dim)).astype(np.float32)


@pytest.mark.parametrize("config", [LR, EMB])
@pytest.mark.parametrize("precision", ["f32", "f16", "int8"])
def test_reads_match_a_trainers_table_through_deltas(config: TableConfig, precision: str) -> None:
    rng = np.random.default_rng(1)
    ref = SparseTable(config)
    table = ReadTable(config, precision)
    keys, w = rows(rng, 20_000, config.dim)
    deleted = np.zeros(0, np.uint64)
    for step in range(4):
        if step:
            # a delta: some rows changed, some new, some deleted
            new_keys, new_w = rows(rng, 2_000, config.dim)
            keys = np.concatenate([keys[:500], new_keys])
            w = np.concatenate([rng.normal(0, 0.3, (500, config.dim)).astype(np.float32), new_w])
            keys, first = np.unique(keys, return_index=True)
            w = w[first]
            deleted = np.setdiff1d(ref.index.row_keys[: ref.index.num_rows][ref.index.row_live][600:700], keys)
        ref.load_rows(keys, w, *_meta(keys.size))
        if deleted.size:
            ref.delete(deleted)
        table.apply(keys, w, deleted)
        live = ref.index.row_keys[: ref.index.num_rows][ref.index.row_live]
        probe = np.concatenate([live, deleted, rng.integers(0, 2**64, 50, dtype=np.uint64, endpoint=False)])
        assert len(table) == len(ref)
        np.testing.assert_array_equal(table.contains(probe), ref.index.lookup(probe) >= 0)
        got, want = table.pull(probe), ref.pull(probe)
        if precision == "f32":
            np.testing.assert_array_equal(got, want)
        elif precision == "f16":
            np.testing.assert_allclose(got, want, rtol=2**-11, atol=2**-25)
        else:
            # a bucket's step is at most 2 * max|w| / 127 (power-of-two scales), and a
            # row re-gridded when its bucket's exponent grew is off by up to 1.5 steps
            assert np.abs(got - want).max() <= 1.5 * 2 * np.abs(want).max() / 127
    bytes_per_value = {"f32": 4, "f16": 2, "int8": 1}[precision]
    st = table.state
    assert table.memory_bytes() - st.exps.nbytes - st.directory.nbytes == len(table) * (
        8 + bytes_per_value * config.dim
    )
    assert st.directory.nbytes <= 4 * (len(table) / 4 + 2)  # at most a byte a key: a run holds >= 4 keys
    assert st.exps.nbytes <= (len(table) / 32 + 1 if precision == "int8" else 0)


def _meta(n: int) -> tuple[np.ndarray, ...]:
    return (np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.float32), np.zeros(n, np.float32))


def test_int8_rows_a_delta_leaves_alone_keep_their_exact_value() -> None:
    rng = np.random.default_rng(2)
    table = ReadTable(LR, "int8")
    keys, w = rows(rng, 10_000)
    table.apply(keys, w)
    before = table.pull(keys)
    # a delta of small weights: no bucket's largest magnitude grows
    table.apply(keys[:100], np.full((100, 1), 1e-4, np.float32))
    np.testing.assert_array_equal(table.pull(keys[100:]), before[100:])
    assert 2**table.state.bucket_bits * 64 == pytest.approx(keys.size, rel=1.0)


def test_absent_keys_read_as_a_trainers_table_reads_them() -> None:
    lazy = TableConfig("v", 4, {"name": "sgd"}, init_scale=0.05, lifecycle=Lifecycle(embed_threshold=2.0))
    probe = np.arange(1, 50, dtype=np.uint64)
    for config in (LR, EMB, lazy):
        for precision in ("f32", "int8"):
            table = ReadTable(config, precision)
            np.testing.assert_array_equal(table.pull(probe), SparseTable(config).pull(probe))  # empty
            table.apply(probe[:5], np.ones((5, config.dim), np.float32))
            np.testing.assert_array_equal(table.pull(probe[5:]), SparseTable(config).pull(probe[5:]))


def test_a_refused_version_changes_nothing() -> None:
    table = ReadTable(LR, "f16")
    table.apply(np.array([1, 2], np.uint64), np.ones((2, 1), np.float32))
    state = table.state
    with pytest.raises(ValueError, match="lists a key twice"):
        table.prepare(np.array([5, 5], np.uint64), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="NaN or infinity"):
        table.prepare(np.array([5], np.uint64), np.array([[np.nan]], np.float32))
    assert table.state is state
    with pytest.raises(ValueError, match="precision"):
        ReadTable(LR, "f8")


def test_a_block_exponent_is_the_smallest_that_fits_its_largest_magnitude_in_127() -> None:
    # One rule for a replica's buckets and an int8 serving file's runs of rows.
    rng = np.random.default_rng(5)
    top = np.concatenate([np.abs(rng.normal(0, 3, 500)), [127.0, 127.5, 254.0, 1e-3, 2.0**-140, 0.0]]).astype(
        np.float32
    )
    exps = block_exponents(top)
    fits = top <= np.ldexp(np.float32(127), exps)
    smallest = top > np.ldexp(np.float32(127), exps - 1)
    assert (fits | (exps == 127)).all() and (smallest | (exps == NO_EXP)).all()
    assert exps[-1] == NO_EXP and exps[-2] == NO_EXP and exps[-6] == 0 and exps[-5] == 1
    weights = rng.normal(0, 0.3, (130, 3)).astype(np.float32)
    codes, file_exps = block_int8(weights)
    per_row = np.repeat(file_exps.astype(np.int32), 64)[:130]
    assert (codes == block_codes(weights, per_row)).all()
    assert (
        np.abs(np.ldexp(codes.astype(np.float32), per_row[:, None]) - weights) <= np.ldexp(0.5, per_row[:, None])
    ).all()
