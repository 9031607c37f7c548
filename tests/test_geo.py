"""Geo mode: workers train local copies and push parameter differences the
shards add. Deltas are added exactly, changes by one worker reach another
within one round, the local copy stays bounded, and the mode learns the
synthetic stream as well as async does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from streams import (
    all_running,
    applications,
    bias_shows,
    brisk_worker_config,
    committed,
    group_of,
    keyed_event,
    new_topic,
    produce,
)
from training import window_of
from waiting import until

from app.api.follower import model_from_manifest
from consumers.decode import decode_records
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import latest_chain, read_manifest, write_version
from ps_core.checkpoint.restore import restore_shards
from ps_core.model.batch import EventBatch
from ps_core.model.geo import GeoCopy
from ps_core.model.models import LogisticRegression, make_model
from ps_core.net.change_feed import ChangeFeed
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.store.change_log import ChangeLog
from ps_core.store.optim import FTRL, AdaGrad, CoinBetting, FTRLMixture, Optimizer
from ps_core.store.table_config import TableConfig
from ps_core.synthetic import SyntheticStream

SGD = {"name": "sgd", "lr": 0.1}
COIN = {"name": "coin", "wealth": 0.1}
MIX = {"name": "ftrl_mix", "alpha_1": 0.02, "alpha_2": 0.2, "l1_2": 2.0}


def _shards(tables: tuple[TableConfig, ...], n: int = 2) -> list[Shard]:
    return [Shard(ShardSpec(i, n), tables) for i in range(n)]


_FEEDS: dict[int, ChangeFeed] = {}


async def _round(
    copy: GeoCopy, client: PSClient, keys: np.ndarray, grads: np.ndarray, scale: float, *, log: bool = True
) -> None:
    """One mini-batch on `copy` (pulling what it must) and the round's push,
    then the shards' report of what others changed (`log`), as
    `GeoTraining` does; without `log`, no report: every row goes stale."""
    feed = _FEEDS.setdefault(id(copy), ChangeFeed(client, ["w"]))
    rows, need = copy.locate(keys)
    if need.any():
        rows = copy.take(keys, rows, need, {"w": await client.pull("w", keys[need])})
    copy.train(rows, {"w": grads}, np.zeros((keys.size, 2), np.float32))
    d = copy.deltas(scale)
    rid = client.new_request_id()
    _, merged = await client.push_pull("w", d.keys, d.values["w"], pull_keys=d.keys, request_id=rid)
    feed.pushed("w", rid)
    copy.merge(d.rows, {"w": merged})
    copy.end_round(d.rows, await feed.read() if log else None)


async def test_the_shards_add_every_scaled_delta_exactly() -> None:
    # SGD from zero: a copy's difference after its steps is -lr · Σ its
    # gradients, so whatever the interleaving the shards must end at
    # -lr · scale · Σ every worker's gradients.
    config = TableConfig("w", 3, SGD, init_scale=0.0, mode="geo")
    shards = _shards((config,))
    client = PSClient.local(shards)
    copies = [GeoCopy([config]), GeoCopy([config])]
    rng = np.random.default_rng(11)
    universe = np.arange(1, 200, dtype=np.uint64)
    total = np.zeros((universe.size, 3))
    for _ in range(40):
        who = int(rng.integers(2))
        keys = np.sort(rng.choice(universe, size=int(rng.integers(1, 60)), replace=False))
        grads = rng.normal(size=(keys.size, 3)).astype(np.float32)
        await _round(copies[who], client, keys, grads, 0.5)
        total[keys.astype(np.int64) - 1] += grads
    got = await client.pull("w", universe)
    np.testing.assert_allclose(got, -0.1 * 0.5 * total, rtol=1e-4, atol=1e-5)
    assert sum(c.rounds for c in copies) == 40


async def test_a_key_changed_by_one_worker_reaches_the_other_within_one_round() -> None:
    config = TableConfig("w", 1, SGD, init_scale=0.0, mode="geo")
    client = PSClient.local(_shards((config,)))
    a, b = GeoCopy([config]), GeoCopy([config])
    keys, other = np.array([3, 8, 21], np.uint64), np.array([5, 6], np.uint64)
    one = np.ones((3, 1), np.float32)
    await _round(b, client, keys, one, 1.0)  # b's push-pull: its copy is current
    await _round(a, client, keys, one, 1.0)  # then a changes the keys on the shards
    # b trains them again from its copy; its round's push-pull brings a's change.
    rows, need = b.locate(keys)
    assert not need.any()
    await _round(b, client, keys, one, 1.0)
    np.testing.assert_allclose(b.weights(b.locate(keys)[0])["w"], -0.3 * one, rtol=1e-6)
    # A round without the keys leaves b's copy of them stale: a changes them
    # meanwhile, and b's next use reads them again, a's change included.
    await _round(b, client, other, np.ones((2, 1), np.float32), 1.0)
    await _round(a, client, keys, one, 1.0)
    rows, need = b.locate(keys)
    assert need.all()
    rows = b.take(keys, rows, need, {"w": await client.pull("w", keys)})
    np.testing.assert_allclose(b.weights(rows)["w"], -0.4 * one, rtol=1e-6)
    assert b.pushed_keys == 8 and b.pulled_keys == 3 + 2 + 3


async def test_the_local_copy_drops_its_least_recently_trained_rows_past_its_cap() -> None:
    config = TableConfig("w", 1, SGD, mode="geo")
    client = PSClient.local(_shards((config,)))
    copy = GeoCopy([config], max_rows=50)
    for start in range(0, 400, 40):  # 40 new keys a round
        keys = np.arange(start + 1, start + 41, dtype=np.uint64)
        await _round(copy, client, keys, np.ones((40, 1), np.float32), 1.0)
        assert len(copy) <= 50
    # Down to nine tenths of the cap: the last round's 40 keys and 5 of the
    # round before stay, current; the older ones went.
    assert len(copy) == 45 and copy.dropped_rows == 400 - 45
    assert not copy.locate(np.arange(361, 401, dtype=np.uint64))[1].any()
    assert (copy.index.lookup(np.arange(1, 321, dtype=np.uint64)) < 0).all()
    assert copy.index.num_rows <= 90  # freed rows are reused: the arrays stay small


async def test_a_round_nobody_else_changed_reads_nothing_again() -> None:
    config = TableConfig("w", 1, SGD, init_scale=0.0, mode="geo")
    client = PSClient.local(_shards((config,)))
    a, b = GeoCopy([config]), GeoCopy([config])
    keys, others = np.arange(1, 41, dtype=np.uint64), np.arange(100, 110, dtype=np.uint64)
    await _round(a, client, keys, np.ones((40, 1), np.float32), 0.5)
    await _round(a, client, keys, np.ones((40, 1), np.float32), 0.5)
    # The first report is incomplete (a new copy: every row but those just
    # merged is stale; here all were merged).
    assert a.full_refreshes == 1 and a.pulled_keys == 40
    await _round(b, client, others, np.ones((10, 1), np.float32), 0.5)  # keys a never holds
    for _ in range(3):
        await _round(a, client, keys, np.ones((40, 1), np.float32), 0.5)
    assert a.pulled_keys == 40 and a.refreshed_rows == 0 and a.full_refreshes == 1
    # Without a report, a round leaves every row but those merged stale.
    await _round(a, client, keys[:10], np.ones((10, 1), np.float32), 0.5, log=False)
    assert a.locate(keys)[1].sum() == 30


async def test_rows_the_shards_removed_or_replaced_are_read_again() -> None:
    config = TableConfig("w", 1, SGD, init_scale=0.0, mode="geo")
    shards = _shards((config,), n=1)
    client = PSClient.local(shards)
    copy = GeoCopy([config])
    keys = np.arange(1, 21, dtype=np.uint64)
    for _ in range(2):
        await _round(copy, client, keys, np.ones((20, 1), np.float32), 1.0)
    assert not copy.locate(keys)[1].any()
    shards[0].tables["w"].delete(keys[:5])  # an eviction: the rows are gone
    await _round(copy, client, keys[10:], np.ones((10, 1), np.float32), 1.0)
    assert np.flatnonzero(copy.locate(keys)[1]).tolist() == [0, 1, 2, 3, 4]
    # Another log (a restarted or restored shard's) answers incomplete, and
    # so does one that no longer reaches back: every row but those merged
    # is then read again.
    shards[0].tables["w"].changes = ChangeLog(max_keys=40)  # a 20-key entry and a bit
    await _round(copy, client, keys[:2], np.ones((2, 1), np.float32), 1.0)
    assert copy.full_refreshes == 2 and copy.locate(keys)[1].sum() == 18
    await _round(copy, client, keys, np.ones((20, 1), np.float32), 1.0)
    assert copy.full_refreshes == 2 and not copy.locate(keys)[1].any()
    other = GeoCopy([config])
    for start, n in ((50, 6), (60, 20)):  # the second drops the first, which copy has not seen
        await _round(other, client, np.arange(start, start + n, dtype=np.uint64), np.ones((n, 1), np.float32), 1.0)
    await _round(copy, client, keys[:3], np.ones((3, 1), np.float32), 1.0)
    assert copy.full_refreshes == 3 and copy.locate(keys)[1].sum() == 17


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        (FTRL(alpha=0.1, l1=0.5), slice(4, None)),
        (AdaGrad(lr=0.1), slice(4, None)),
        (CoinBetting(wealth=2.0, lipschitz=0.5), slice(4, None)),
        # 2 learners' [z, n, m]: n is the state; m is among its weights.
        (FTRLMixture(alpha_1=0.1, alpha_2=0.3, l1_2=0.0), slice(2, 4)),
    ],
    ids=["ftrl", "adagrad", "coin", "ftrl_mix"],
)
def test_setting_weights_keeps_the_optimizer_state(optimizer: Optimizer, state: slice) -> None:
    rng = np.random.default_rng(2)
    rows = optimizer.rows_from_weights(rng.normal(size=(64, 4)).astype(np.float32))
    for _ in range(5):
        optimizer.step(rows, rng.normal(size=(64, 4)).astype(np.float32))
    kept = rows[:, state].copy()
    w = rng.normal(size=(64, 4)).astype(np.float32)
    w[::7] = 0.0
    optimizer.set_weights(rows, w)
    np.testing.assert_allclose(optimizer.weights(rows, 4), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rows[:, state], kept)


async def _progressive(
    mode: str,
    kind: str,
    values: list[bytes | None],
    workers: int,
    ramp: int = 0,
    optimizers: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """Windows of 2000 events dealt to `workers` workers in turn over the same
    2 shards; the progressive metrics of the second half of the stream.
    Without a mini-batch `ramp` by default: the modes compared at the same
    mini-batches (sync has none). `optimizers`: the model's, if not its defaults."""
    model = make_model(kind, "m", mode=mode, **(optimizers or {}))
    shards = _shards(tuple(model.tables()))
    crew = [
        Worker(
            WorkerConfig(
                "unused:9092", mini_batch=256, mini_batch_ramp=ramp, decode_processes=0, mode=mode, geo_steps=8
            ),
            PSClient.local(shards),
            ControlClient.local(shards),
            model,
        )
        for _ in range(workers)
    ]
    for w in crew:  # each would own half of the topic's partitions
        w._geo_scale = lambda: 1.0 / workers  # type: ignore[method-assign]
    results = []
    for i, start in enumerate(range(0, len(values), 2000)):
        part = values[start : start + 2000]
        batch = decode_records(part, "m", 1 << 20).batch

        async def one(b: EventBatch = batch) -> AsyncIterator[EventBatch]:
            yield b

        w = crew[i % workers]
        results.append(await w.training.train(one(), window_of(part)))
    second = results[len(results) // 2 :]
    events = sum(m.events for m in second)
    auc = sum(m.auc * m.events for m in second) / events
    logloss = sum(m.logloss * m.events for m in second) / events
    return auc, logloss


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "ramp", "optimizers"),
    [
        ("lr", 0, {}),
        ("fm", 0, {}),
        ("lr", 64, {}),
        pytest.param("fm", 64, {"optimizer": COIN, "embedding_optimizer": COIN}, id="fm-coin"),
        pytest.param("lr", 64, {"optimizer": MIX}, id="lr-ftrl_mix"),
        pytest.param("fm", 0, {"optimizer": MIX}, id="fm-ftrl_mix"),
    ],
)
async def test_one_geo_worker_trains_exactly_as_one_async_worker(
    kind: str, ramp: int, optimizers: dict[str, Any]
) -> None:
    # Scale 1: each round adds exactly what the copy learnt; with a ramp,
    # both modes' mini-batches grow alike. (That geo with two workers learns
    # as well as async: tests/test_sync.py, with sync.) A coin copy's rows
    # take the merged weights by moving their anchor `w0`, betting state kept.
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=5).batch(20_000)]
    alone = await _progressive("geo", kind, values, 1, ramp, optimizers)
    same = await _progressive("async", kind, values, 1, ramp, optimizers)
    assert alone[0] == pytest.approx(same[0], abs=1e-6) and alone[1] == pytest.approx(same[1], rel=1e-4)


@pytest.mark.slow
async def test_two_geo_workers_over_the_broker_apply_every_event_once(kafka_bootstrap: str) -> None:
    partitions, n = 4, 6000
    topic, group = await new_topic(kafka_bootstrap, partitions)
    model = LogisticRegression("m", mode="geo")
    shards = _shards(tuple(model.tables()))
    config = brisk_worker_config(kafka_bootstrap, topic, group, 400, 128, mode="geo", geo_steps=4)
    workers = group_of(config, shards, model)

    async def both_assigned() -> bool:
        return all(w._consumer is not None and len(w._consumer.assignment()) == 2 for w in workers)

    async def all_committed() -> bool:
        return sum((await committed(kafka_bootstrap, group, topic, partitions)).values()) >= n

    async with all_running(workers, 30):
        await until(both_assigned, 30, what="both workers to get 2 partitions", poll_s=0.1)
        assert [w._geo_scale() for w in workers] == [0.5, 0.5]
        await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(n)), partitions)
        await until(all_committed, 60, what="every event committed", poll_s=0.1)
    # Every event counted once: the bias moves every round, so its shows are
    # all pushed. A keyed event's own id, seen once, mostly never moves
    # (FTRL's L1 holds it at 0): no row on the shards for it.
    assert bias_shows(shards) == n == sum(w.stats.events_trained for w in workers)
    assert all(w.stats.geo_rounds > 0 for w in workers)
    # The shards' change logs answered: only a copy's first round (and one
    # after a rebalance drops it) reads every row again.
    assert all(1 <= w.stats.geo_full_refreshes < w.stats.geo_rounds / 2 for w in workers)
    assert all(w.geo is not None and w.geo.pulled_keys < 3 * n for w in workers)
    unmoved = sum(w.geo.unmoved_keys for w in workers if w.geo is not None)
    assert unmoved > n / 2
    assert (applications(shards, 0, n) == 0).mean() > 0.5


async def test_a_cut_of_a_geo_model_restores_and_serves_its_weights(tmp_path: Path) -> None:
    model = make_model("fm", "m", mode="geo", k=4)
    shards = _shards(tuple(model.tables()))
    client = PSClient.local(shards)
    copy = GeoCopy(model.tables())
    rng = np.random.default_rng(8)
    keys = np.unique(rng.integers(1, 2**63, 500, dtype=np.uint64))
    rows, need = copy.locate(keys)
    pulled = {t: await client.pull(t, keys) for t in model.table_names}
    rows = copy.take(keys, rows, need, pulled)
    grads = {t.name: rng.normal(size=(keys.size, t.dim)).astype(np.float32) for t in model.tables()}
    copy.train(rows, grads, np.ones((keys.size, 2), np.float32))
    d = copy.deltas(1.0)
    for t in model.table_names:
        await client.push(t, d.keys, d.values[t], counts=d.counts)
    snaps = {s.spec.shard_id: [t.snapshot(None) for t in s.tables.values()] for s in shards}
    write_version(tmp_path, "m", 1, None, snaps, {"clicks": {0: 7}}, model.config(), 2)
    chain = latest_chain(tmp_path / "m")
    assert {n: c.mode for n, c in read_manifest(chain[-1].path).tables.items()} == {"m_w": "geo", "m_v": "geo"}
    restored = restore_shards(chain, 3)
    again = PSClient.local(restored.shards)
    for t in model.table_names:
        np.testing.assert_array_equal(await again.pull(t, keys), await client.pull(t, keys))
        assert restored.shards[0].tables[t].width == restored.shards[0].tables[t].dim  # weights only
    served = model_from_manifest(read_manifest(chain[-1].path))
    assert served.mode == "geo" and served.table_names == model.table_names


async def test_a_cleared_copy_reads_every_row_again() -> None:
    config = TableConfig("w", 1, SGD, mode="geo")
    client = PSClient.local(_shards((config,)))
    copy = GeoCopy([config])
    keys = np.arange(1, 30, dtype=np.uint64)
    await _round(copy, client, keys, np.ones((29, 1), np.float32), 1.0)
    assert not copy.locate(keys)[1].any()
    copy.clear()  # a window failed part-way: the bases may not be the shards'
    rows, need = copy.locate(keys)
    assert need.all() and len(copy) == 0
    rows = copy.take(keys, rows, need, {"w": await client.pull("w", keys)})
    np.testing.assert_allclose(copy.weights(rows)["w"], await client.pull("w", keys))
