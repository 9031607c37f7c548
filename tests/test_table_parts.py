"""The parts a `SparseTable` composes, at their own surface: the row
metadata view (`RowMeta`), export cuts (`Cuts`, `checked_rows`), the push's
admission over a stale pull (`push.admitted`) and the storage's upserts."""

from __future__ import annotations

import numpy as np
import pytest

from ps_core.errors import InvalidValuesError
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.row_meta import CHANGED, MIN_COUNT_SCALE, RowMeta
from ps_core.store.snapshot import MAX_VERSION, checked_rows
from ps_core.store.storage import RowStorage
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig


def keys(*k: int) -> np.ndarray:
    return np.array(k, dtype=np.uint64)


def test_decay_past_the_smallest_scale_folds_it_into_every_row() -> None:
    t = SparseTable(TableConfig("w"))  # FTRL: a push reuses the rows its pull gathered
    k = keys(1, 2, 3)
    t.push(k, np.zeros(3, np.float32), counts=np.float32([[8, 2], [4, 0], [2, 1]]), event_time=100)
    t.snapshot()  # nothing changed since this cut
    factor = 1e-13
    t.rows_meta.decay(factor)
    assert t.count_scale == factor and not t.changed().any()  # through the scale only
    t.pull(k)  # gathers the rows as they are now
    t.rows_meta.decay(factor)  # 1e-26: below the smallest scale
    assert factor * factor < MIN_COUNT_SCALE and t.count_scale == 1.0
    rows = t.index.lookup(k)
    np.testing.assert_allclose(t.shows[rows], np.float32([8, 4, 2]) * np.float32(1e-26), rtol=1e-5)
    np.testing.assert_allclose(t.clicks[rows], np.float32([2, 0, 1]) * np.float32(1e-26), rtol=1e-5)
    assert t.changed()[rows].all()  # every row rewritten: the next delta holds all
    # The pull gathered the counts before the rescale: its push must not write them back.
    t.push(k, np.zeros(3, np.float32), counts=np.float32([[1, 0]] * 3), event_time=100)
    np.testing.assert_allclose(t.shows[rows], 1.0, rtol=1e-5)
    assert t.snapshot(t.last_snapshot).rows == 3


def test_stamp_adds_counts_against_the_scale_and_flags_the_rows() -> None:
    storage = RowStorage(1)
    meta = RowMeta(storage)
    meta.count_scale = 0.5
    block = np.zeros((2, 3), np.uint32)
    meta.stamp(block, 1234.9, np.array([[3.0, 1.0], [0.0, 0.0]]))
    assert block[:, 0].tolist() == [1234, 1234] and meta.newest_event == 1234.9
    assert (block[:, 1] & CHANGED).all()
    shows = (block[:, 1] & ~CHANGED).view(np.float32)
    assert shows.tolist() == [6.0, 0.0] and block[:, 2].view(np.float32).tolist() == [2.0, 0.0]
    meta.stamp(block, 10.0, None)  # an older event leaves the clock
    assert meta.newest_event == 1234.9 and block[:, 0].tolist() == [10, 10]


def test_load_counts_checks_the_scale_and_ignores_cells_of_another_sketch() -> None:
    lc = Lifecycle(admit="count:2", sketch_bytes=1024)
    t = SparseTable(TableConfig("w", lifecycle=lc))
    with pytest.raises(InvalidValuesError, match="count_scale 0 is not in"):
        t.load_counts(0, [], [])
    with pytest.raises(InvalidValuesError, match="count_scale 1.5"):
        t.load_counts(1.5, [], [])
    assert t.admission is not None and t.admission.sketch is not None
    cells = t.admission.sketch.cells
    t.load_counts(0.25, [cells.size + 5], [7])  # a bigger sketch's cell: does not map
    assert t.count_scale == 0.25 and not cells.any()
    t.load_counts(0.5, [3, 9], [7, 1])
    assert cells.reshape(-1)[[3, 9]].tolist() == [7, 1] and int(cells.sum()) == 8


def test_mark_exported_refuses_versions_rows_cannot_carry() -> None:
    t = SparseTable(TableConfig("w"))
    for bad in (-1, MAX_VERSION + 1):
        with pytest.raises(ValueError, match=f"version {bad} outside"):
            t.mark_exported(bad)
    t.mark_exported(MAX_VERSION)
    assert t.last_snapshot == MAX_VERSION and t.version == MAX_VERSION + 1


def test_deletes_before_any_cut_are_not_logged_and_after_one_they_are() -> None:
    t = SparseTable(TableConfig("w"))
    t.push(keys(1, 2, 3), np.zeros(3, np.float32))
    t.delete(keys(1))
    base = t.snapshot()
    assert base.deleted.size == 0 and sorted(base.keys.tolist()) == [2, 3]
    t.delete(keys(2, 3, 9))  # 9 was never there
    t.push(keys(3), np.zeros(1, np.float32))  # deleted, then inserted again: a row
    delta = t.snapshot(t.last_snapshot)
    assert delta.deleted.tolist() == [2] and delta.keys.tolist() == [3]


@pytest.mark.parametrize(
    ("data", "meta", "message"),
    [
        (np.zeros((2, 3), np.float32), ([1, 1], [1, 1], [0, 0], [0, 0]), r"rows of shape \(2, 3\), expected \(2, 2\)"),
        (np.zeros((2, 2), np.float32), ([1], [1, 1], [0, 0], [0, 0]), "metadata arrays must hold 2"),
        (np.zeros((2, 2), np.float32), ([1, 1], [-1, 1], [0, 0], [0, 0]), "updated_at and last_seen"),
        (np.zeros((2, 2), np.float32), ([1, 1], [1, 2**32], [0, 0], [0, 0]), "updated_at and last_seen"),
        (np.zeros((2, 2), np.float32), ([1, 1], [1, 1], [0, np.inf], [0, 0]), "shows and clicks"),
        (np.zeros((2, 2), np.float32), ([1, 1], [1, 1], [0, 0], [-1, 0]), "shows and clicks"),
        (np.float32([[0, 0], [np.nan, 0]]), ([1, 1], [1, 1], [0, 0], [0, 0]), "NaN or inf"),
    ],
)
def test_checked_rows_refuses_each_bad_array(data: np.ndarray, meta: tuple[list[float], ...], message: str) -> None:
    with pytest.raises(InvalidValuesError, match=message):
        checked_rows("w", 2, keys(1, 2), data, tuple(np.asarray(m) for m in meta))


def test_upsert_distinct_refuses_repeated_keys_and_inserts_nothing() -> None:
    storage = RowStorage(2)
    rows, new = storage.upsert_distinct(keys(5, 6), "w")
    assert new.size == 2 and storage.index.size == 2
    with pytest.raises(InvalidValuesError, match="must be distinct"):
        storage.upsert_distinct(keys(7, 5, 7), "w")
    assert storage.index.size == 2 and storage.index.lookup(keys(7))[0] == -1
    again, new = storage.upsert_distinct(keys(6, 8), "w")
    assert again[0] == rows[1] and new.size == 1 and storage.rows.shape[0] >= storage.index.num_rows


def test_a_gated_push_after_inserts_since_its_pull_finds_the_new_rows() -> None:
    # The push of the pulled keys goes through admission (here the gate): a
    # key the pull found absent was inserted since, so it has a row now and
    # is updated, not refused as a key without one.
    t = SparseTable(TableConfig("w", optimizer={"name": "sgd", "lr": 1.0}))
    k = keys(1, 2)
    t.pull(k)
    t.push(keys(2), np.float32([1.0]))
    t.gate = lambda k: np.zeros(k.size, dtype=bool)  # no new rows from now on
    assert t.push(k, np.float32([1.0, 1.0])) == 1 and t.gated == 1
    assert len(t) == 1 and t.pull(k).reshape(-1).tolist() == [0.0, -2.0]
