"""SparseTable: pulls that allocate nothing, deterministic initial values,
version stamps, metadata, validation, and declarations on a shard."""

from __future__ import annotations

import numpy as np
import pytest

from ps_core.errors import InvalidValuesError, TableConfigError, TableConflictError, WrongShardError
from ps_core.hashing import shard_of
from ps_core.shard import Push, Shard, ShardSpec
from ps_core.store.index import KeyIndex
from ps_core.store.pull_cache import PullCache
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

FM = TableConfig("fm_v", 8, {"name": "adagrad", "lr": 0.05}, init_scale=0.01, seed=42)


def test_pull_of_absent_keys_allocates_nothing() -> None:
    table = SparseTable(FM)
    before = table.memory_bytes()
    w = table.pull(np.arange(10_000, dtype=np.uint64))
    assert w.shape == (10_000, 8) and w.dtype == np.float32
    assert len(table) == 0
    assert table.memory_bytes() == before


def test_initial_values_are_a_pure_function_of_key_and_seed() -> None:
    keys = np.array([0, 1, 5, 2**64 - 1, 123456789], dtype=np.uint64)
    a = SparseTable(FM).pull(keys)
    b = SparseTable(FM).pull(keys[::-1])[::-1]
    np.testing.assert_array_equal(a, b)
    assert np.abs(a).max() <= 0.01 and np.abs(a).min() > 0
    assert len({tuple(r) for r in a.tolist()}) == len(keys)  # distinct per key
    other_seed = SparseTable(TableConfig("fm_v", 8, {"name": "adagrad"}, init_scale=0.01, seed=43))
    assert not np.array_equal(a, other_seed.pull(keys))
    # A row created by a zero-gradient push starts at exactly that value.
    t = SparseTable(FM)
    t.push(keys, np.zeros((keys.size, 8), dtype=np.float32))
    np.testing.assert_array_equal(t.pull(keys), a)


def test_ftrl_rows_start_at_their_initial_value() -> None:
    cfg = TableConfig("e", 4, {"name": "ftrl", "l1": 0.5}, init_scale=0.1, seed=1)
    t = SparseTable(cfg)
    keys = np.arange(50, dtype=np.uint64)
    before = t.pull(keys)
    t.push(keys, np.zeros((50, 4), dtype=np.float32))
    np.testing.assert_allclose(t.pull(keys), before, rtol=1e-6, atol=1e-8)


def test_pull_mixes_present_and_absent_in_caller_order() -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd", "lr": 1.0}))
    t.push(np.array([10, 20], dtype=np.uint64), np.array([1.0, -2.0], dtype=np.float32))
    got = t.pull(np.array([20, 99, 10, 20], dtype=np.uint64))[:, 0]
    assert got.tolist() == [2.0, 0.0, -1.0, 2.0]


def test_changed_rows_are_those_since_the_last_cut() -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd"}))
    t.push(np.array([1, 2, 3], dtype=np.uint64), np.ones(3, dtype=np.float32))
    assert sorted(t.changed_rows()[0].tolist()) == [1, 2, 3]
    t.snapshot()  # a cut: nothing changed since
    assert t.changed_rows()[0].size == 0
    t.push(np.array([3, 4], dtype=np.uint64), np.ones(2, dtype=np.float32))
    keys, rows = t.changed_rows()
    assert sorted(keys.tolist()) == [3, 4]
    assert rows.shape == (2,)
    t.delete(np.array([4], dtype=np.uint64))
    assert sorted(t.changed_rows()[0].tolist()) == [3]
    # Counts of a changed row read without the flag.
    row = t.index.lookup(np.array([3], dtype=np.uint64))
    t.push(np.array([3], dtype=np.uint64), np.ones(1, dtype=np.float32), counts=np.array([[5, 2]], np.float32))
    assert t.shows[row].tolist() == [5.0] and t.clicks[row].tolist() == [2.0]


def test_metadata_counts_and_last_seen() -> None:
    t = SparseTable(TableConfig("lr", 1))
    keys = np.array([5, 6, 5], dtype=np.uint64)
    counts = np.array([[1, 1], [1, 0], [1, 0]], dtype=np.float32)
    t.push(keys, np.zeros(3, dtype=np.float32), counts=counts, event_time=1_764_681_600.7)
    rows = t.index.lookup(np.array([5, 6], dtype=np.uint64))
    assert t.shows[rows].tolist() == [2, 1]
    assert t.clicks[rows].tolist() == [1, 0]
    assert t.last_seen[rows].tolist() == [1_764_681_600, 1_764_681_600]
    assert t.changed()[rows].tolist() == [True, True]


@pytest.mark.parametrize(
    "grads, counts",
    [
        (np.array([0.1, np.nan], dtype=np.float32), None),
        (np.array([np.inf, 0.0], dtype=np.float32), None),
        (np.array([0.1, 0.2], dtype=np.float32), np.array([[1, 0], [-1, 0]], dtype=np.float32)),
        (np.zeros((2, 3), dtype=np.float32), None),
    ],
    ids=["nan", "inf", "negative-count", "wrong-dim"],
)
def test_invalid_push_changes_nothing(grads: np.ndarray, counts: np.ndarray | None) -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd", "lr": 1.0}))
    t.push(np.array([1], dtype=np.uint64), np.array([1.0], dtype=np.float32))
    before = (len(t), t.pull(np.array([1, 2], dtype=np.uint64)).copy(), t.pushes)
    with pytest.raises(InvalidValuesError):
        t.push(np.array([1, 2], dtype=np.uint64), grads, counts=counts)
    assert (len(t), t.pushes) == (before[0], before[2])
    np.testing.assert_array_equal(t.pull(np.array([1, 2], dtype=np.uint64)), before[1])


def test_memory_grows_with_features() -> None:
    t = SparseTable(TableConfig("lr", 1))
    small = t.memory_bytes()
    t.push(np.arange(100_000, dtype=np.uint64), np.full(100_000, 0.1, dtype=np.float32))
    assert len(t) == 100_000
    assert t.memory_bytes() > small
    assert t.memory_bytes() / len(t) < 80


def test_config_normalised_and_round_trips() -> None:
    a = TableConfig("lr", 1, {"name": "ftrl"})
    b = TableConfig.from_dict({"name": "lr", "optimizer": "ftrl"})
    c = TableConfig.from_dict(a.to_dict())
    assert a == b == c
    assert a.optimizer == {"name": "ftrl", "alpha": 0.05, "beta": 1.0, "l1": 1.0, "l2": 1.0}


@pytest.mark.parametrize(
    "raw",
    [
        {"name": "", "dim": 1},
        {"name": "has space"},
        {"name": "x", "dim": 0},
        {"name": "x", "dim": "4"},
        {"name": "x", "init_scale": -1},
        {"name": "x", "optimizer": {"name": "nope"}},
        {"name": "x", "colour": "red"},
        ["not", "an", "object"],
    ],
)
def test_bad_declarations_rejected(raw: object) -> None:
    with pytest.raises(TableConfigError):
        TableConfig.from_dict(raw)


SEVEN = {f"alpha_{i}": 0.1 for i in range(1, 8)}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"name": "x", "optimizer": "ftrl_mix"}, "table x: a mixture of 5 learners has 10 weights a row, not 1"),
        (
            {"name": "x", "dim": 4, "optimizer": {"name": "ftrl_mix"}},
            "a mixture of 5 learners has 10 weights a row, not 4",
        ),
        (
            {"name": "x", "dim": 2, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "l1_2": 1}},
            "l1_2 without its alpha_i",
        ),
        ({"name": "x", "dim": 10, "optimizer": {"name": "ftrl_mix", "l1_2": 1}}, "l1_2 without its alpha_i"),
        ({"name": "x", "dim": 4, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_3": 0.2}}, "without gaps"),
        ({"name": "x", "dim": 2, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "lr": 0.1}}, "no hyperparameter lr"),
        ({"name": "x", "dim": 14, "optimizer": {"name": "ftrl_mix", **SEVEN}}, "no hyperparameter alpha_7"),
        ({"name": "x", "dim": 10, "optimizer": {"name": "ftrl_mix", "cap": 0}}, "cap >= 1e-12"),
        (
            {"name": "x", "dim": 10, "optimizer": "ftrl_mix", "init_scale": 0.1},
            "table x: a mixture of learners starts at zero",
        ),
    ],
)
def test_a_mixture_table_of_the_wrong_dim_or_learners_is_refused_naming_why(raw: object, reason: str) -> None:
    with pytest.raises(TableConfigError) as refused:
        TableConfig.from_dict(raw)
    assert reason in refused.value.detail


def test_a_mixture_table_holds_three_columns_a_learner() -> None:
    cfg = TableConfig("x", 4, {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.3})
    assert cfg.optimizer == {
        "name": "ftrl_mix",
        **{"alpha_1": 0.1, "l1_1": 0.5, "alpha_2": 0.3, "l1_2": 0.5, "beta": 0.1, "l2": 1.0, "cap": 32.0},
    }
    assert TableConfig.from_dict(cfg.to_dict()) == cfg
    assert SparseTable(cfg).width == 6  # [z, n, m] per learner
    assert (
        SparseTable(TableConfig("x", 12, {"name": "ftrl_mix", **{f"alpha_{i}": 0.1 for i in range(1, 7)}})).width == 18
    )


def test_shard_declarations_are_idempotent_and_never_overwrite() -> None:
    shard = Shard()
    assert shard.declare(TableConfig("lr", 1)) is True
    assert shard.declare(TableConfig("lr", 1, {"name": "ftrl", "alpha": 0.05})) is False
    with pytest.raises(TableConflictError):
        shard.declare(TableConfig("lr", 1, {"name": "ftrl", "alpha": 0.1}))
    with pytest.raises(TableConflictError):
        shard.declare(TableConfig("lr", 2))
    assert shard.tables["lr"].config == TableConfig("lr", 1)


def test_shard_refuses_keys_it_does_not_own() -> None:
    shard = Shard(ShardSpec(0, 2), [TableConfig("lr", 1)])
    keys = np.arange(100, dtype=np.uint64)
    mine = keys[shard_of(keys, 2) == 0]
    shard.handle_push(Push("lr", mine, np.ones((mine.size, 1), dtype=np.float32)))
    with pytest.raises(WrongShardError):
        shard.handle_push(Push("lr", keys, np.ones((100, 1), dtype=np.float32)))
    with pytest.raises(WrongShardError):
        shard.handle_pull("lr", keys)
    assert len(shard.tables["lr"]) == mine.size


@pytest.mark.parametrize("event_time", [float("nan"), float("inf"), -1.0, 2.0**33])
def test_bad_event_time_changes_nothing(event_time: float) -> None:
    t = SparseTable(TableConfig("lr", 1, {"name": "sgd", "lr": 1.0}))
    with pytest.raises(InvalidValuesError, match="event time"):
        t.push(np.array([1], dtype=np.uint64), np.array([1.0], dtype=np.float32), event_time=event_time)
    assert len(t) == 0 and t.pushes == 0
    assert t.pull(np.array([1], dtype=np.uint64))[0, 0] == 0.0


def test_counts_must_be_whole_and_saturate_instead_of_overflowing() -> None:
    # Counts are float32 (decay makes fractions): past 2**32 they neither
    # wrap nor overflow; at float32's largest they stay there.
    t = SparseTable(TableConfig("lr", 1))
    key, g = np.array([3], dtype=np.uint64), np.zeros(1, dtype=np.float32)
    with pytest.raises(InvalidValuesError, match="whole"):
        t.push(key, g, counts=np.array([[0.5, 0]], dtype=np.float32))
    t.push(key, g, counts=np.array([[5e9, 1]], dtype=np.float32))
    t.push(key, g, counts=np.array([[1, 1]], dtype=np.float32))
    row = t.index.lookup(key)
    assert t.shows[row].tolist() == [float(np.float32(5e9))]
    assert t.clicks[row].tolist() == [2]
    big = float(np.finfo(np.float32).max)
    t.push(key, g, counts=np.array([[big, 0]], dtype=np.float32))
    t.push(key, g, counts=np.array([[big, 0]], dtype=np.float32))
    assert t.shows[row].tolist() == [big]


REUSE_CONFIGS = [
    # FTRL from zero: the push also reuses the rows and weights the pull derived.
    TableConfig("t", 1, {"name": "ftrl", "alpha": 0.1, "beta": 1.0, "l1": 0.0, "l2": 0.0}),
    TableConfig("t", 2, {"name": "ftrl", "alpha": 0.1, "beta": 0.5, "l1": 0.3, "l2": 0.1}),
    # Random initial values: fresh rows are derived per key.
    TableConfig("t", 3, {"name": "adagrad", "lr": 0.2}, init_scale=0.05, seed=4),
    TableConfig("t", 2, {"name": "ftrl", "l1": 0.1}, init_scale=0.05, seed=4),
    # Coin: weights derived from five blocks, from zero and from random starts.
    TableConfig("t", 1, {"name": "coin"}),
    TableConfig("t", 3, {"name": "coin", "wealth": 0.5}, init_scale=0.05, seed=4),
    # A mixture: 2K weights (K learners', then their log-weights) from rows of 3K.
    TableConfig("t", 10, {"name": "ftrl_mix"}),  # its 5 default learners
    TableConfig("t", 4, {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.3, "l1_2": 0.0}),
]


def _same_tables(warm: SparseTable, cold: SparseTable, universe: np.ndarray) -> None:
    """Equal bit for bit: weights, state and metadata of every key."""
    assert warm.index.size == cold.index.size
    np.testing.assert_array_equal(warm.pull(universe), cold.pull(universe))
    for t in (warm, cold):
        n = t.index.num_rows
        live = t.index.row_keys[:n][t.index.row_live[:n]]
        assert np.unique(live).size == live.size == t.index.size  # no key got two rows
    wr, cr = warm.index.lookup(universe), cold.index.lookup(universe)
    assert ((wr >= 0) == (cr >= 0)).all()
    wr, cr = wr[wr >= 0], cr[cr >= 0]
    assert warm.data[wr].view(np.uint32).tolist() == cold.data[cr].view(np.uint32).tolist()
    np.testing.assert_array_equal(warm.meta[wr], cold.meta[cr])


@pytest.mark.parametrize(
    "cfg",
    REUSE_CONFIGS,
    ids=["ftrl", "ftrl-l1", "adagrad-init", "ftrl-init", "coin", "coin-init", "ftrl_mix", "ftrl_mix-2"],
)
@pytest.mark.parametrize("seed", range(4))
def test_a_push_reusing_its_pull_lookup_equals_a_cold_push(cfg: TableConfig, seed: int) -> None:
    """Pull-then-push reuses the pull's lookup (and with FTRL what it
    gathered); interleaved pushes (inserting keys the pull saw absent,
    changing rows it read), loads and deletes (freeing rows) must not fool
    it, with keys ascending (as a worker sends them), shuffled or repeated."""
    rng = np.random.default_rng(seed)
    warm, cold = SparseTable(cfg), SparseTable(cfg)
    universe = np.arange(1, 400, dtype=np.uint64)
    pending: list[np.ndarray] = []

    def some_keys() -> np.ndarray:
        keys = rng.choice(universe, size=int(rng.integers(1, 60)), replace=False)
        shape = rng.integers(0, 4)
        if shape:  # repeated, ascending, or ascending with repeats
            if shape != 2:
                keys = np.concatenate([keys, keys[: int(rng.integers(1, 4))]])
            if shape != 1:
                keys = np.sort(keys)
        return keys

    def grads(n: int) -> np.ndarray:
        return rng.normal(size=(n, cfg.dim)).astype(np.float32)

    for _ in range(200):
        action = rng.integers(0, 5)
        if action == 0:  # pull now, push later (possibly after other operations)
            keys = some_keys()
            warm.pull(keys)
            pending.append(keys)
        elif action == 1 and pending:
            keys = pending.pop(int(rng.integers(0, len(pending))))
            g = grads(keys.size)
            counts = np.stack([np.ones(keys.size), rng.integers(0, 2, keys.size)], axis=1).astype(np.float32)
            assert warm.push(keys, g, counts=counts, event_time=5.0) == cold.push(
                keys, g, counts=counts, event_time=5.0
            )
        elif action == 2:  # a push nobody pulled for: inserts keys behind a pull's back
            keys, g = some_keys(), None
            g = grads(keys.size)
            warm.push(keys, g, event_time=6.0)
            cold.push(keys, g, event_time=6.0)
        elif action == 3:  # a restore-style load, also behind the pulls' backs
            keys = rng.choice(universe, size=10, replace=False)
            state = np.abs(rng.normal(size=(10, warm.width))).astype(np.float32)
            meta = [np.full(10, v, dtype=np.uint32) for v in (1, 7, 3, 1)]
            assert warm.load_rows(keys, state, *meta) == cold.load_rows(keys, state, *meta)
        else:
            gone = rng.choice(universe, size=20, replace=False)
            assert sorted(warm.delete(gone).tolist()) == sorted(cold.delete(gone).tolist())
    _same_tables(warm, cold, universe)


@pytest.mark.parametrize("cfg", REUSE_CONFIGS[:3], ids=["ftrl", "ftrl-l1", "adagrad-init"])
def test_push_reusing_a_pull_after_another_push_inserted_some_keys(cfg: TableConfig) -> None:
    """Between a pull and its push, another push inserts some of the keys the
    pull found absent and updates some it found present."""
    warm, cold = SparseTable(cfg), SparseTable(cfg)
    rng = np.random.default_rng(1)
    first = np.arange(0, 200, 2, dtype=np.uint64)
    for t in (warm, cold):
        t.push(first, np.ones((first.size, cfg.dim), dtype=np.float32), event_time=1.0)
    keys = np.arange(100, 300, dtype=np.uint64)  # half present, half absent
    g = rng.normal(size=(keys.size, cfg.dim)).astype(np.float32)
    warm.pull(keys)
    between = np.arange(150, 260, 3, dtype=np.uint64)  # some of either half
    gb = rng.normal(size=(between.size, cfg.dim)).astype(np.float32)
    for t in (warm, cold):
        t.push(between, gb, event_time=2.0)
    counts = np.ones((keys.size, 2), dtype=np.float32)
    assert warm.push(keys, g, counts=counts, event_time=3.0) == cold.push(keys, g, counts=counts, event_time=3.0)
    _same_tables(warm, cold, np.arange(0, 320, dtype=np.uint64))


@pytest.mark.parametrize("cfg", REUSE_CONFIGS[:3], ids=["ftrl", "ftrl-l1", "adagrad-init"])
@pytest.mark.parametrize("ordered", [False, True], ids=["shuffled", "ascending"])
def test_push_of_repeated_keys_reusing_a_pull_sums_them(cfg: TableConfig, ordered: bool) -> None:
    """A pull and push naming keys twice (present and absent ones) reuse the
    lookup but not its per-occurrence rows: the push sums, then steps once.
    Keys in ascending order with repeats are not mistaken for distinct."""
    warm, cold = SparseTable(cfg), SparseTable(cfg)
    for t in (warm, cold):
        t.push(np.array([1, 2], dtype=np.uint64), np.ones((2, cfg.dim), dtype=np.float32))
    keys = np.array([3, 1, 3, 2, 1, 4], dtype=np.uint64)
    g = np.arange(6 * cfg.dim, dtype=np.float32).reshape(6, cfg.dim) / 10
    counts = np.array([[1, 0], [1, 1], [1, 1], [1, 0], [2, 0], [1, 0]], dtype=np.float32)
    distinct = np.array([1, 2, 3, 4], dtype=np.uint64)
    summed = np.stack([g[[1, 4]].sum(0), g[3], g[[0, 2]].sum(0), g[5]])
    if ordered:  # each occurrence keeps its gradient and counts
        order = np.argsort(keys, kind="stable")
        keys, g, counts = keys[order], g[order], counts[order]
    warm.pull(keys)
    assert warm.push(keys, g, counts=counts, event_time=9.0) == 4
    cold.push(distinct, summed, counts=np.array([[3, 1], [1, 0], [2, 1], [1, 0]], dtype=np.float32), event_time=9.0)
    _same_tables(warm, cold, np.arange(0, 6, dtype=np.uint64))
    rows = warm.index.lookup(distinct)
    assert warm.shows[rows].tolist() == [3, 1, 2, 1] and warm.clicks[rows].tolist() == [1, 0, 1, 0]


def test_the_pull_cache_hands_out_only_what_still_holds() -> None:
    """`PullCache.take`: an entry once, for exactly its keys; its free slots
    dropped after an index change, its gathered rows after a row change or
    when older than the latest two pulls; nothing after `clear`."""
    index = KeyIndex()
    cache = PullCache(index)
    keys = np.array([5, 9], dtype=np.uint64)

    def pull(k: np.ndarray) -> None:
        rows, free = index.probe(k)
        missing = np.flatnonzero(rows < 0)
        gathered = (np.zeros((k.size, 4), np.uint32), np.zeros((k.size, 1), np.float32), np.zeros(k.size, np.float32))
        cache.add(k, rows, missing, free.take(missing), gathered)

    pull(keys)
    assert cache.take(keys[:1]) is None and cache.take(keys[::-1]) is None
    got = cache.take(keys)
    assert got is not None and got.free is not None and got.gathered is not None
    assert got.missing.tolist() == [0, 1] and cache.take(keys) is None  # handed out once
    pull(keys)
    index.get_or_insert(np.array([77], dtype=np.uint64))
    got = cache.take(keys)
    assert got is not None and got.free is None and got.gathered is not None
    pull(keys)
    cache.wrote()
    got = cache.take(keys)
    assert got is not None and got.free is not None and got.gathered is None
    for k in (keys, keys + 1, keys + 2):
        pull(k)
    old, newer = cache.take(keys), cache.take(keys + 1)
    assert old is not None and old.gathered is None and newer is not None and newer.gathered is not None
    pull(keys)
    cache.clear()
    assert cache.take(keys) is None
