"""KeyIndex against a dict reference: random inserts, lookups, deletes, growth,
colliding and extreme keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ps_core.store.index import KeyIndex

U64_MAX = 2**64 - 1

# Small pools make duplicates, re-inserts after delete and probe collisions likely;
# the extremes check that no key value is reserved as a sentinel.
key_pool = st.one_of(
    st.integers(0, 40),
    st.sampled_from([0, 1, U64_MAX, U64_MAX - 1, 2**63, 2**32]),
    st.integers(0, U64_MAX),
)
key_batches = st.lists(key_pool, min_size=0, max_size=60)


def _arr(keys: list[int]) -> np.ndarray:
    return np.array(keys, dtype=np.uint64)


class IndexMachine(RuleBasedStateMachine):
    """Every operation on the index agrees with a dict of key -> row."""

    def __init__(self) -> None:
        super().__init__()
        # Tiny initial table: growth and rehash happen within a few rules.
        self.index = KeyIndex(initial_slots=16, max_load=0.6)
        self.ref: dict[int, int] = {}

    @rule(keys=key_batches)
    def get_or_insert(self, keys: list[int]) -> None:
        rows, new_rows, new_keys = self.index.get_or_insert(_arr(keys))
        assert rows.shape == (len(keys),)
        expected_new = sorted(set(k for k in keys if k not in self.ref))
        assert sorted(int(k) for k in new_keys) == expected_new
        assert len(set(new_rows.tolist())) == len(new_rows)
        for k, r in zip(keys, rows.tolist()):
            if k in self.ref:
                assert r == self.ref[k]
            else:
                self.ref[k] = r
        # Distinct live keys never share a row.
        assert len(set(self.ref.values())) == len(self.ref)

    @rule(keys=key_batches)
    def lookup(self, keys: list[int]) -> None:
        rows = self.index.lookup(_arr(keys))
        assert rows.tolist() == [self.ref.get(k, -1) for k in keys]

    @rule(keys=key_batches)
    def probe_then_insert_absent(self, keys: list[int]) -> None:
        """The push path: a lookup's first free slots steer the insert of the
        keys it found absent (with tombstones about, and duplicates)."""
        k = _arr(keys)
        rows, free = self.index.probe(k)
        assert rows.tolist() == [self.ref.get(x, -1) for x in keys]
        missing = np.flatnonzero(rows < 0)
        if not missing.size:
            return
        got, new_rows, new_keys = self.index.insert_absent(k[missing], free[missing])
        assert sorted(int(x) for x in new_keys) == sorted(set(keys) - set(self.ref))
        assert len(set(new_rows.tolist())) == len(new_rows)
        for x, r in zip(k[missing].tolist(), got.tolist()):
            assert self.ref.setdefault(x, r) == r

    @rule(keys=key_batches)
    def delete(self, keys: list[int]) -> None:
        removed = self.index.delete(_arr(keys))
        expected = sorted(set(k for k in keys if k in self.ref))
        assert sorted(int(k) for k in removed) == expected
        for k in expected:
            del self.ref[k]

    @invariant()
    def sizes_agree(self) -> None:
        assert self.index.size == len(self.ref)
        assert self.index.size <= self.index.max_load * self.index.num_slots

    @invariant()
    def rows_name_their_keys(self) -> None:
        for k, r in self.ref.items():
            assert int(self.index.row_keys[r]) == k
            assert bool(self.index.row_live[r])


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@given(st.lists(st.integers(0, U64_MAX), max_size=3000))
@settings(max_examples=60, deadline=None)
def test_bulk_insert_then_lookup_matches_dict(keys: list[int]) -> None:
    index = KeyIndex(initial_slots=16)
    rows, _, _ = index.get_or_insert(_arr(keys))
    ref: dict[int, int] = {}
    for k, r in zip(keys, rows.tolist()):
        assert ref.setdefault(k, r) == r
    assert index.size == len(ref)
    probe = _arr(list(ref) + [k ^ 0x5A5A for k in ref])
    expected = [ref.get(int(k), -1) for k in probe]
    assert index.lookup(probe).tolist() == expected


def test_colliding_home_slots_are_all_found() -> None:
    """Keys crafted to share one home slot make one long probe chain, including
    chains that wrap around the end of the slot array."""
    index = KeyIndex(initial_slots=1 << 12, max_load=0.9)
    candidates = np.arange(0, 2_000_000, dtype=np.uint64)
    homes = index._home(candidates)
    last = index.num_slots - 1
    same = candidates[homes == last][:300]  # home = last slot: chains wrap to 0
    assert same.size >= 200
    rows, _, _ = index.get_or_insert(same)
    assert index.lookup(same).tolist() == rows.tolist()
    # Delete every other one: the survivors stay reachable across tombstones.
    index.delete(same[::2])
    assert (index.lookup(same[::2]) == -1).all()
    assert index.lookup(same[1::2]).tolist() == rows[1::2].tolist()
    # Reinserting reuses tombstones and freed rows.
    rows2, new_rows, _ = index.get_or_insert(same[::2])
    assert set(new_rows.tolist()) <= set(rows[::2].tolist())
    expected = rows.copy()
    expected[::2] = rows2
    assert index.lookup(same).tolist() == expected.tolist()


def test_growth_rehash_keeps_every_key() -> None:
    rng = np.random.default_rng(7)
    index = KeyIndex(initial_slots=16)
    keys = rng.integers(0, 2**64, size=200_000, dtype=np.uint64)
    rows_by_batch = [index.get_or_insert(keys[i : i + 10_000])[0] for i in range(0, keys.size, 10_000)]
    assert index.num_slots >= 200_000 / 0.6
    assert index.lookup(keys).tolist() == np.concatenate(rows_by_batch).tolist()


def test_tombstones_reclaimed_on_rehash() -> None:
    rng = np.random.default_rng(3)
    index = KeyIndex(initial_slots=1024)
    slots_before = index.num_slots
    # Churn: insert and delete repeatedly; the slot array must not keep growing.
    for _ in range(30):
        keys = rng.integers(0, 2**64, size=300, dtype=np.uint64)
        index.get_or_insert(keys)
        index.delete(keys)
    assert index.size == 0
    assert index.num_slots == slots_before
    assert index._tombstones <= index.max_load * index.num_slots


def test_empty_inputs() -> None:
    index = KeyIndex()
    assert index.lookup(np.zeros(0, dtype=np.uint64)).shape == (0,)
    rows, new_rows, new_keys = index.get_or_insert(np.zeros(0, dtype=np.uint64))
    assert rows.size == new_rows.size == new_keys.size == 0
    assert index.delete(np.zeros(0, dtype=np.uint64)).size == 0


def test_bad_load_factor_rejected() -> None:
    with pytest.raises(ValueError):
        KeyIndex(max_load=0.99)


def _chain_free_slot(index: KeyIndex, key: int) -> int:
    """The first EMPTY or TOMBSTONE slot of a key's probe chain, by a scan."""
    pos = int(index._home(_arr([key]))[0])
    while index._slots[pos] >= 0:
        pos = (pos + 1) % index.num_slots
    return pos


@pytest.mark.parametrize("deletes", [False, True], ids=["no-tombstones", "tombstones"])
def test_probe_reports_each_absent_keys_first_free_slot(deletes: bool) -> None:
    """At a high load (long chains, windows past 32 slots, wrap-around) the
    free slot `probe` reports is the one a scan of the chain finds."""
    rng = np.random.default_rng(5)
    index = KeyIndex(initial_slots=1 << 10, max_load=0.9)
    keys = rng.integers(0, 2**64, 900, dtype=np.uint64)
    index.get_or_insert(keys)
    if deletes:
        index.delete(keys[::3])
        assert index._tombstones > 0
    probe = np.concatenate([keys, rng.integers(0, 2**64, 2000, dtype=np.uint64)])
    rows, free = index.probe(probe)
    np.testing.assert_array_equal(rows, index.lookup(probe))
    absent = np.flatnonzero(rows < 0)
    assert absent.size >= 2000
    assert index.size / index.num_slots > 0.55  # long chains
    assert free[absent].tolist() == [_chain_free_slot(index, int(x)) for x in probe[absent]]


def test_insert_absent_with_free_slots_matches_plain_inserts() -> None:
    """Hinted inserts (several keys sharing a first free slot among them)
    give the same rows and an index that finds every key, as without hints."""
    rng = np.random.default_rng(9)
    base = rng.integers(0, 2**64, 500, dtype=np.uint64)
    new = rng.integers(0, 2**64, 300, dtype=np.uint64)
    plain, hinted = KeyIndex(initial_slots=1 << 10, max_load=0.9), KeyIndex(initial_slots=1 << 10, max_load=0.9)
    for index in (plain, hinted):
        index.get_or_insert(base)
        index.delete(base[::5])
    rows, free = hinted.probe(new)
    assert (rows < 0).all()
    assert np.unique(free).size < free.size  # some keys contend for one slot
    got_h, rows_h, keys_h = hinted.insert_absent(new, free)
    got_p, rows_p, keys_p = plain.insert_absent(new)
    np.testing.assert_array_equal(got_h, got_p)
    np.testing.assert_array_equal(rows_h, rows_p)
    np.testing.assert_array_equal(keys_h, keys_p)
    everything = np.concatenate([base, new])
    np.testing.assert_array_equal(hinted.lookup(everything), plain.lookup(everything))
    assert hinted.size == plain.size and hinted._tombstones == plain._tombstones


@pytest.mark.parametrize("layout", ["ascending", "shuffled", "repeats"])
def test_insert_absent_key_orders(layout: str) -> None:
    """Ascending keys skip the sort; any order hands rows out in key order."""
    rng = np.random.default_rng(2)
    keys = np.unique(rng.integers(0, 2**64, 200, dtype=np.uint64))
    if layout == "shuffled":
        keys = rng.permutation(keys)
    elif layout == "repeats":
        keys = np.concatenate([keys, keys[::7]])
    index = KeyIndex()
    got, new_rows, new_keys = index.insert_absent(keys)
    np.testing.assert_array_equal(new_keys, np.unique(keys))
    np.testing.assert_array_equal(new_rows, np.arange(new_keys.size))
    np.testing.assert_array_equal(got, new_rows[np.searchsorted(new_keys, keys)])
    np.testing.assert_array_equal(index.lookup(keys), got)
