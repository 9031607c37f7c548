"""The feature lifecycle (`ps_core.store.lifecycle`, `SparseTable.evict`):
each admission rule against a reference on a seeded stream, each eviction
rule removing exactly the rows it should, and restores and replicas that
equal the live table after evictions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from app.api.follower import Follower
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.shard import ShardSettings, parse_table_spec
from ps_core.checkpoint.export_files import latest_chain, write_version
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import TableConfigError, TableConflictError
from ps_core.hashing import shard_of
from ps_core.model.models import make_model
from ps_core.shard import Shard, ShardSpec
from ps_core.store.lifecycle import NO_LIFECYCLE, CountSketch, Lifecycle
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

U64 = npt.NDArray[np.uint64]
SGD = {"name": "sgd", "lr": 1.0}


def table(**rules: object) -> SparseTable:
    return SparseTable(TableConfig("t", 1, SGD, lifecycle=Lifecycle(**rules)))  # type: ignore[arg-type]


def stream(rng: np.random.Generator, pushes: int, size: int, ids: int = 5000) -> list[U64]:
    """Pushes of distinct keys drawn from a long tail (Zipf), as a worker sends them."""
    return [np.unique(np.minimum(rng.zipf(1.2, size), ids).astype(np.uint64) + 1) for _ in range(pushes)]


def ones(k: U64) -> npt.NDArray[np.float32]:
    return np.ones(k.size, dtype=np.float32)


def live_keys(t: SparseTable) -> set[int]:
    n = t.index.num_rows
    return set(t.index.row_keys[:n][t.index.row_live[:n]].tolist())


def weight(t: SparseTable, key: int) -> float:
    return float(t.pull(np.array([key], dtype=np.uint64))[0, 0])


# -- admission ---------------------------------------------------------------------


def test_count_admission_matches_an_exact_count() -> None:
    # A key gets its row at the push that brings its count to N; pushes
    # before are dropped; SGD with lr 1 and gradient 1 makes the weight
    # minus the pushes since. The sketch is large for the ids: no collision.
    n_admit = 3
    t = table(admit=f"count:{n_admit}")
    seen: dict[int, int] = {}
    applied: dict[int, int] = {}
    dropped = 0
    for k in stream(np.random.default_rng(1), 300, 40):
        t.push(k, ones(k))
        for key in k.tolist():
            seen[key] = seen.get(key, 0) + 1
            if seen[key] >= n_admit:
                applied[key] = applied.get(key, 0) + 1
            else:
                dropped += 1
    assert live_keys(t) == set(applied)
    assert all(weight(t, key) == -pushes for key, pushes in applied.items())
    assert all(weight(t, key) == 0.0 for key in set(seen) - set(applied))
    assert t.admission is not None
    assert (t.admission.admitted, t.admission.dropped) == (len(applied), dropped)


def test_count_admission_counts_shows_when_a_push_carries_them() -> None:
    t = table(admit="count:5")
    k = np.array([7, 8], dtype=np.uint64)
    t.push(k, ones(k), counts=np.array([[4, 0], [5, 1]], dtype=np.float32))
    assert live_keys(t) == {8}
    t.push(k, ones(k), counts=np.array([[1, 0], [1, 0]], dtype=np.float32))
    assert live_keys(t) == {7, 8}
    assert weight(t, 7) == -1.0 and weight(t, 8) == -2.0


def test_a_pull_then_push_admits_as_a_push_alone() -> None:
    # The push reuses the pull's lookup (rows, free slots, gathered rows): with
    # keys dropped from it, the positions must stay right.
    config = TableConfig("t", 1, {"name": "ftrl"}, lifecycle=Lifecycle(admit="count:2"))
    a, b = SparseTable(config), SparseTable(config)
    rng = np.random.default_rng(3)
    for k in stream(rng, 200, 30, ids=400):
        g = rng.normal(size=k.size).astype(np.float32)
        a.pull(k)
        a.push(k, g)
        b.push(k, g)
    keys = np.array(sorted(live_keys(b)), dtype=np.uint64)
    assert live_keys(a) == live_keys(b)
    np.testing.assert_array_equal(a.pull(keys), b.pull(keys))


def test_prob_admission_admits_at_its_rate() -> None:
    p, n = 0.2, 20_000
    t = table(admit=f"prob:{p}")
    keys = np.arange(1, n + 1, dtype=np.uint64)
    t.push(keys, ones(keys))
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(len(t) - n * p) < 5 * sigma
    # P per occurrence: a push of keys shown 3 times admits 1 - (1 - P)**3 of them.
    t3 = table(admit=f"prob:{p}")
    counts = np.tile(np.array([[3, 0]], dtype=np.float32), (n, 1))
    t3.push(keys, ones(keys), counts=counts)
    q = 1 - (1 - p) ** 3
    assert abs(len(t3) - n * q) < 5 * (n * q * (1 - q)) ** 0.5


def test_score_admission_follows_the_scalar_rule() -> None:
    threshold, seed = 2.0, 11
    lc = Lifecycle(admit=f"score:{threshold}", click_coeff=1.0, nonclick_coeff=0.25)
    t = SparseTable(TableConfig("t", 1, SGD, seed=seed, lifecycle=lc))
    rng = np.random.default_rng(5)
    draws = np.random.default_rng([seed, 0xAD417])  # the table's generator, drawn as it draws
    expected: set[int] = set()
    next_key = 1
    for _ in range(50):
        k = np.arange(next_key, next_key + 40, dtype=np.uint64)
        next_key += 40
        shows = rng.integers(0, 12, k.size)
        clicks = np.minimum(rng.integers(0, 3, k.size), shows)
        t.push(k, ones(k), counts=np.stack([shows, clicks], axis=1).astype(np.float32))
        for key, s, c in zip(k.tolist(), shows.tolist(), clicks.tolist()):
            score = max(0.0, (s - c) * 0.25 + c * 1.0)
            u = draws.random()
            if score >= threshold or (score > 0 and u < score / threshold):
                expected.add(key)
    assert live_keys(t) == expected
    assert 0 < len(expected) < next_key - 1


def test_the_sketch_overcounts_never_and_ages() -> None:
    sketch = CountSketch(4096)
    keys = np.arange(1, 3001, dtype=np.uint64)
    truth = np.random.default_rng(2).integers(1, 4, keys.size)
    sketch.add(keys, truth.astype(np.float64))
    assert (sketch.estimate(keys) >= truth).all()
    before = sketch.cells.copy()
    # Ten times the width in increments halves every counter.
    more = np.arange(10_000, 10_000 + 10 * sketch.width, dtype=np.uint64)
    sketch.add(more, np.ones(more.size))
    assert sketch.agings == 1
    assert (sketch.cells <= np.maximum(before, 255) // 2 + 1).all()


# -- eviction ----------------------------------------------------------------------


def test_ttl_removes_exactly_the_rows_unseen_for_longer() -> None:
    t = table(ttl_s=100.0)
    for i, ts in enumerate([1000, 1050, 1100, 1150, 1200]):
        k = np.array([i + 1], dtype=np.uint64)
        t.push(k, ones(k), event_time=ts)
    # The newest event is at 1200: rows unseen for over 100 s (before 1100) go.
    report = t.evict()
    assert live_keys(t) == {3, 4, 5}
    assert report.by_rule == {"ttl": 2, "score": 0, "max_rows": 0}
    assert report.scanned == 5 and report.bytes_freed > 0


def test_decayed_scores_remove_exactly_the_rows_below_the_threshold() -> None:
    decay, min_score = 0.5, 1.0
    t = table(decay=decay, min_score=min_score, nonclick_coeff=0.1, click_coeff=1.0)
    rng = np.random.default_rng(8)
    keys = np.arange(1, 201, dtype=np.uint64)
    shows = rng.integers(0, 60, keys.size).astype(np.float64)
    shows[:10] = 1000  # pushed again between passes, so never removed (nor inserted anew)
    clicks = np.minimum(rng.integers(0, 4, keys.size), shows)
    t.push(keys, ones(keys), counts=np.stack([shows, clicks], 1).astype(np.float32))
    alive = set(keys.tolist())
    for passes in range(1, 5):
        # New counts between passes are stored against the current scale.
        t.push(keys[:10], ones(keys[:10]), counts=np.tile(np.float32([[2, 0]]), (10, 1)))
        shows[:10] += 2
        shows *= decay
        clicks *= decay
        score = (shows - clicks) * 0.1 + clicks * 1.0
        report = t.evict()
        gone = {int(k) for k, s in zip(keys.tolist(), score) if s < min_score} & alive
        alive -= gone
        assert live_keys(t) == alive, passes
        assert report.by_rule["score"] == len(gone)
        rows = t.index.lookup(np.array(sorted(alive), dtype=np.uint64))
        np.testing.assert_allclose(t.shows[rows] * t.count_scale, shows[np.array(sorted(alive)) - 1], rtol=1e-6)
    assert t.count_scale == decay**4


def test_the_row_cap_removes_the_lowest_scores_down_to_the_low_water_mark() -> None:
    t = table(max_rows=100, low_water=0.8)
    keys = np.arange(1, 131, dtype=np.uint64)
    shows = np.random.default_rng(4).permutation(keys.size).astype(np.float32)  # distinct scores
    t.push(keys, ones(keys), counts=np.stack([shows, np.zeros_like(shows)], 1))
    report = t.evict()
    kept = {int(k) for k, s in zip(keys.tolist(), shows) if s >= 130 - 80}
    assert live_keys(t) == kept and len(t) == 80
    assert report.by_rule["max_rows"] == 50
    # Under the cap nothing goes; freed rows are reused, so the arrays stop growing.
    capacity = t.index.row_capacity
    assert t.evict().removed == 0
    more = np.arange(1000, 1020, dtype=np.uint64)
    t.push(more, ones(more))
    assert t.index.row_capacity == capacity and len(t) == 100


def test_a_pass_in_steps_removes_what_one_step_does() -> None:
    # TTL and the decayed score are exact in steps; the cap's cut comes from
    # a sample, so it lands near the low-water mark.
    rules = {"ttl_s": 50.0, "decay": 0.5, "min_score": 0.3, "max_rows": 3000, "low_water": 0.8}
    whole, stepped = table(**rules), table(**rules)
    rng = np.random.default_rng(9)
    for i in range(10):
        k = np.arange(i * 1000 + 1, i * 1000 + 1001, dtype=np.uint64)
        counts = np.stack([rng.integers(0, 20, k.size), rng.integers(0, 3, k.size)], 1).astype(np.float32)
        for t in (whole, stepped):
            t.push(k, ones(k), counts=counts, event_time=1000.0 + 10 * i)
    one = whole.evict()
    steps = list(stepped.eviction_steps(step_rows=700))
    assert len(steps) == 15 and steps[-1] is stepped.last_eviction
    report = steps[-1]
    assert report.by_rule["ttl"] == one.by_rule["ttl"] > 0
    assert report.by_rule["score"] == one.by_rule["score"] > 0
    assert abs(len(stepped) - 0.8 * 3000) <= 0.05 * 3000 and len(whole) == 2400
    assert stepped.count_scale == whole.count_scale == 0.5  # one decay per pass


def test_rules_run_in_order_and_count_a_row_once() -> None:
    t = table(ttl_s=10.0, min_score=0.5, decay=1.0, max_rows=3, low_water=0.5)
    keys = np.arange(1, 9, dtype=np.uint64)
    shows = np.array([9, 9, 0, 0, 5, 6, 7, 8], dtype=np.float32)
    t.push(keys, ones(keys), counts=np.stack([shows, np.zeros_like(shows)], 1), event_time=100)
    t.push(keys[:2], ones(keys[:2]), event_time=50)  # old: TTL takes 1 and 2 (high scores)
    report = t.evict()
    # TTL: 1, 2; score < 0.5 (shows 0 → 0): 3, 4; cap 3 → low water 1: of 5..8 the highest stays.
    assert report.by_rule == {"ttl": 2, "score": 2, "max_rows": 3}
    assert live_keys(t) == {8}


# -- exports, restores and replicas ------------------------------------------------------


def lifecycle_rows(shards: list[Shard], name: str) -> dict[int, tuple[tuple[float, ...], float, float]]:
    """Per live key: weights, and shows and clicks as the rules read them."""
    out: dict[int, tuple[tuple[float, ...], float, float]] = {}
    for shard in shards:
        t = shard.tables[name]
        n = t.index.num_rows
        rows = np.flatnonzero(t.index.row_live[:n])
        w = t.optimizer.weights(t.data[rows], t.dim).tolist()
        for key, wi, s, c in zip(t.index.row_keys[rows].tolist(), w, t.shows[rows], t.clicks[rows]):
            out[key] = (tuple(wi), float(s) * t.count_scale, float(c) * t.count_scale)
    return out


def push_routed(shards: list[Shard], rng: np.random.Generator) -> None:
    """A round of pushes, each key to its shard, with shows and clicks."""
    dim = shards[0].tables["ctr_w"].dim
    for k in stream(rng, 20, 60, ids=3000):
        g = rng.normal(size=(k.size, dim)).astype(np.float32)
        counts = np.stack([rng.integers(1, 4, k.size), rng.integers(0, 2, k.size)], 1).astype(np.float32)
        owner = shard_of(k, len(shards))
        for shard in shards:
            sel = owner == shard.spec.shard_id
            shard.tables["ctr_w"].push(k[sel], g[sel], counts=counts[sel], event_time=1000)


def cut(root: Path, shards: list[Shard]) -> int:
    """Eviction passes, then a cut written (a base when nothing was cut yet)."""
    for shard in shards:
        shard.evict()
    t = shards[0].tables["ctr_w"]
    version, last = t.version, (t.last_snapshot or None)
    snaps = {s.spec.shard_id: [s.tables["ctr_w"].snapshot(last)] for s in shards}
    write_version(root, "ctr", version, last, snaps, {}, make_model("lr", "ctr").config(), len(shards))
    return version


LIFECYCLE = Lifecycle(admit="count:2", decay=0.9, min_score=0.3, max_rows=600, low_water=0.8)


def test_a_restore_after_evictions_equals_the_live_table(tmp_path: Path) -> None:
    model = make_model("lr", "ctr")  # the default: a linear table of 5 learners' weights and log-weights
    assert model.tables()[0].dim == 10
    shards = [Shard(ShardSpec(i, 2), model.tables(), lifecycle=LIFECYCLE) for i in range(2)]
    rng = np.random.default_rng(12)
    for _ in range(4):
        push_routed(shards, rng)
        cut(tmp_path, shards)
    live = lifecycle_rows(shards, "ctr_w")
    assert sum(sum(s.tables["ctr_w"].evicted.values()) for s in shards) > 0
    restored = restore_shards(latest_chain(tmp_path / "ctr"), 2).shards
    assert lifecycle_rows(restored, "ctr_w") == live
    for a, b in zip(shards, restored):
        ta, tb = a.tables["ctr_w"], b.tables["ctr_w"]
        assert ta.config == tb.config and tb.lifecycle == LIFECYCLE
        assert ta.admission is not None and tb.admission is not None
        assert ta.admission.sketch is not None and tb.admission.sketch is not None
        np.testing.assert_array_equal(ta.admission.sketch.cells, tb.admission.sketch.cells)
        assert ta.count_scale == tb.count_scale


async def test_a_replica_following_deltas_with_deletions_equals_the_trainer(tmp_path: Path) -> None:
    model = make_model("lr", "ctr")
    shards = [Shard(ShardSpec(0, 1), model.tables(), lifecycle=LIFECYCLE)]
    rng = np.random.default_rng(21)
    push_routed(shards, rng)
    cut(tmp_path, shards)
    follower = Follower(tmp_path / "ctr", model, interval_s=3600)
    assert await follower.poll()
    for _ in range(3):
        push_routed(shards, rng)
        cut(tmp_path, shards)
        assert await follower.poll()
        replica = follower.transport.shard
        # The replica holds the weights (and no counts: it neither learns nor evicts).
        weights = {k: w for k, (w, _, _) in lifecycle_rows(shards, "ctr_w").items()}
        held = replica.tables["ctr_w"]
        assert dict(zip(held.keys.tolist(), map(tuple, held.weights().tolist()))) == weights
        assert len(replica.tables["ctr_w"]) <= LIFECYCLE.max_rows
    assert sum(shards[0].tables["ctr_w"].evicted.values()) > 0


def test_format_1_snapshots_read_as_whole_counts_without_decay() -> None:
    config = TableConfig("t", 1, SGD)
    snap = TableSnapshot(
        table="t",
        config=config,
        version=1,
        kind="base",
        parent=None,
        keys=np.array([1], dtype=np.uint64),
        data=np.zeros((1, 1), dtype=np.float32),
        updated_at=np.ones(1, dtype=np.uint32),
        last_seen=np.ones(1, dtype=np.uint32),
        shows=np.array([7], dtype=np.uint32),
        clicks=np.array([2], dtype=np.uint32),
        deleted=np.zeros(0, dtype=np.uint64),
    )
    assert snap.shows.dtype == np.float32 and snap.shows.tolist() == [7.0]
    assert snap.count_scale.tolist() == [1.0] and snap.sketch_cells.size == 0


# -- declarations and settings ------------------------------------------------------------


def test_table_specs_carry_the_rules() -> None:
    config = parse_table_spec("lr,admit=count:3,ttl=604800,max_rows=50000000")
    assert config.lifecycle == Lifecycle(admit="count:3", ttl_s=604800.0, max_rows=50_000_000)
    assert TableConfig.from_dict(config.to_dict()) == config
    assert parse_table_spec("lr").lifecycle is None
    assert parse_table_spec("lr,admit=none").lifecycle is None  # the default says nothing
    for bad in ("lr,admit=count:0", "lr,admit=prob:2", "lr,admit=often", "lr,max_rows=x", "lr,decay=0"):
        with pytest.raises(SettingsError):
            parse_table_spec(bad)


def test_shard_flags_set_the_lifecycle_of_tables_declared_without_one() -> None:
    settings = ShardSettings.from_env({"CTRPS_ADMIT": "prob:0.5", "CTRPS_MAX_ROWS": "1000", "CTRPS_TTL": "60"})
    lc = settings.default_lifecycle()
    assert lc == Lifecycle(admit="prob:0.5", max_rows=1000, ttl_s=60.0)
    # Every rule has its flag (and its variable): the score's coefficients and the sketch too.
    parser = build_parser()
    args = parser.parse_args(
        ["shard", "--admit", "count:3", "--ttl", "604800", "--decay", "0.9", "--min-score", "0.5"]
        + ["--max-rows", "50000000", "--low-water", "0.8", "--embed-threshold", "2", "--click-coeff", "2"]
        + ["--nonclick-coeff", "0.05", "--sketch-bytes", "1048576", "--evict-interval", "30"]
    )
    flagged = ShardSettings.from_args(args, {})
    assert flagged.default_lifecycle() == Lifecycle(
        admit="count:3",
        ttl_s=604800.0,
        decay=0.9,
        min_score=0.5,
        max_rows=50_000_000,
        low_water=0.8,
        embed_threshold=2.0,
        click_coeff=2.0,
        nonclick_coeff=0.05,
        sketch_bytes=1 << 20,
    )
    assert flagged.evict_interval_s == 30.0
    with pytest.raises(SettingsError, match="admit"):
        ShardSettings.from_env({"CTRPS_ADMIT": "count:999"})
    shard = Shard(lifecycle=lc)
    assert shard.declare(TableConfig("a", 1))
    assert shard.tables["a"].lifecycle == lc
    # A worker's declaration (no lifecycle) is the same table; another lifecycle is a conflict.
    assert not shard.declare(TableConfig("a", 1))
    with pytest.raises(TableConflictError):
        shard.declare(TableConfig("a", 1, lifecycle=Lifecycle(admit="count:2")))
    # The shard's own configuration takes a restored table over to its rules.
    assert shard.configure(TableConfig("a", 1, lifecycle=Lifecycle(max_rows=5)))
    assert shard.tables["a"].lifecycle == Lifecycle(max_rows=5)
    assert shard.tables["a"].admission is None


def test_a_lifecycle_is_checked_when_declared() -> None:
    with pytest.raises(TableConfigError, match="low_water"):
        Lifecycle(low_water=1.0)
    with pytest.raises(TableConfigError, match="unknown lifecycle fields"):
        Lifecycle.from_dict({"admit": "none", "ttl": 5})
    assert Lifecycle.from_dict({}) == NO_LIFECYCLE
    assert Lifecycle(admit=" count:3 ").admit == "count:3"


# -- lazy embeddings -------------------------------------------------------------------


def test_an_embedding_row_waits_for_its_linear_score() -> None:
    lazy = Lifecycle(embed_threshold=2.0, click_coeff=1.0, nonclick_coeff=0.5)
    shard = Shard(
        tables=[
            TableConfig("ctr_w", 1, SGD, lifecycle=Lifecycle(click_coeff=1.0, nonclick_coeff=0.5)),
            TableConfig("ctr_v", 4, SGD, init_scale=0.1, lifecycle=lazy),
        ]
    )
    w, v = shard.tables["ctr_w"], shard.tables["ctr_v"]
    k = np.array([5, 6], dtype=np.uint64)
    grads = np.ones((2, 4), dtype=np.float32)
    # No score yet: no embedding row; the keys read as zeros, not their initial values.
    v.push(k, grads)
    assert len(v) == 0 and v.gated == 2
    np.testing.assert_array_equal(v.pull(k), np.zeros((2, 4), np.float32))
    # Key 5: 3 shows and 1 click score 2 * 0.5 + 1 = 2; key 6: 2 shows, 1.
    w.push(k, np.zeros(2, np.float32), counts=np.array([[3, 1], [2, 0]], dtype=np.float32))
    v.push(k, grads)
    assert live_keys(v) == {5}
    # The row starts at its initial value, then takes the push.
    expected = v.initial_weights(k[:1]) - 1.0
    np.testing.assert_allclose(v.pull(k[:1]), expected, rtol=1e-6)
    assert shard.stats()["tables"]["ctr_v"]["lifecycle"]["embed_gated"] == 3


def test_lazy_embeddings_need_an_embedding_table() -> None:
    with pytest.raises(TableConfigError, match="dim > 1"):
        TableConfig("ctr_w", 1, lifecycle=Lifecycle(embed_threshold=1.0))
    # The shard's default applies it to embedding tables only.
    shard = Shard(lifecycle=Lifecycle(embed_threshold=1.0), tables=[TableConfig("a_w", 1), TableConfig("a_v", 8)])
    assert shard.tables["a_w"].lifecycle.embed_threshold == 0.0
    assert shard.tables["a_v"].lifecycle.embed_threshold == 1.0 and shard.tables["a_v"].gate is not None


def test_a_mixtures_linear_table_is_no_embedding_table() -> None:
    """A mixture's linear table has dim 2K (its learners' weights and
    log-weights), not embeddings: the shard's default lazy embeddings leave
    it alone (gated on itself, it never took a row), and declaring them on
    it is refused."""
    mix = {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.3}
    with pytest.raises(TableConfigError, match="lazy embeddings .* need an embedding table"):
        TableConfig("a_w", 4, mix, lifecycle=Lifecycle(embed_threshold=1.0))
    shard = Shard(lifecycle=Lifecycle(embed_threshold=1.0), tables=[TableConfig("a_w", 4, mix), TableConfig("a_v", 8)])
    w = shard.tables["a_w"]
    assert w.lifecycle.embed_threshold == 0.0 and w.gate is None
    assert shard.tables["a_v"].gate is not None
    keys = np.array([5, 6], dtype=np.uint64)
    w.push(keys, np.ones((2, 4), np.float32), counts=np.ones((2, 2), np.float32))
    assert live_keys(w) == {5, 6} and (w.pull(keys)[:, :2] < 0).all()
