"""Async staleness: every push carries the table clock of the pull its
gradients came from; a shard counts how stale each applied push was and,
under ``max_staleness``, down-weights the staler ones by an exact factor.

Run over every transport (in process, HTTP frames, the TCP RPC), since the
clocks travel in the frames' headers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from ps_core.checkpoint.control import ControlClient
from ps_core.errors import ModeConflictError, PSError, TableConfigError
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.shard import Push, Shard, ShardSpec
from ps_core.store.staleness import BUCKETS, StalenessLog
from ps_core.store.table_config import TableConfig

SGD = {"name": "sgd", "lr": 0.5}

MakeClients = Callable[[TableConfig], Awaitable[tuple[list[PSClient], list[Shard]]]]


@pytest.fixture(params=["local", "http", "rpc"])
async def make_clients(request: pytest.FixtureRequest, serve_shards: Any) -> AsyncIterator[MakeClients]:
    """Two clients (two workers) over the same 2 shards holding `table`."""
    made: list[PSClient] = []

    async def make(table: TableConfig) -> tuple[list[PSClient], list[Shard]]:
        if request.param == "local":
            shards = [Shard(ShardSpec(i, 2), (table,)) for i in range(2)]
            clients = [PSClient.local(shards) for _ in range(2)]
        else:
            shards, urls = await serve_shards(2, (table,), rpc=request.param == "rpc")
            clients = [PSClient.connect(urls, retry=RetryPolicy(deadline_s=2.0)) for _ in range(2)]
        made.extend(clients)
        return clients, shards

    yield make
    for c in made:
        await c.close()


def staleness_of(shards: list[Shard], table: str) -> dict[str, Any]:
    """The table's staleness stats summed over `shards` (buckets added)."""
    per = [s.tables[table].staleness.stats() for s in shards]
    return {
        "buckets": {b: sum(p["buckets"][b] for p in per) for b in per[0]["buckets"]},
        "count": sum(p["count"] for p in per),
        "sum": sum(p["sum"] for p in per),
        "unknown": sum(p["unknown"] for p in per),
        "down_weighted": sum(p["down_weighted"] for p in per),
    }


def test_the_log_buckets_bounds_and_factors() -> None:
    log = StalenessLog(max_staleness=3)
    assert StalenessLog.of(10, 10) == 0 and StalenessLog.of(10, 4) == 6
    assert StalenessLog.of(10, 0) is None  # no base clock sent
    assert StalenessLog.of(10, 11) is None  # a base from before a restore reset the clock
    assert log.factor(None) == log.factor(0) == log.factor(3) == 1.0
    assert log.factor(7) == 0.5 and log.factor(15) == 0.25
    assert StalenessLog().factor(10**6) == 1.0  # unbounded: counted, never scaled
    for s in (0, 0, 1, 3, 4, 5, 2000):
        log.record(s)
    log.record(None)
    stats = log.stats()
    assert list(stats["buckets"]) == [str(b) for b in BUCKETS] + ["+Inf"]
    assert stats["buckets"]["0"] == 2 and stats["buckets"]["1"] == 1 and stats["buckets"]["4"] == 2
    assert stats["buckets"]["8"] == 1 and stats["buckets"]["+Inf"] == 1
    assert (stats["count"], stats["sum"], stats["unknown"], stats["down_weighted"]) == (7, 2013, 1, 3)


async def test_one_worker_in_step_order_is_never_stale(make_clients: MakeClients) -> None:
    table = TableConfig("w", 1, SGD)
    (client, _), shards = await make_clients(table)
    rng = np.random.default_rng(1)
    keys = rng.integers(1, 2**63, 40, dtype=np.uint64)
    routed = client.route(keys)
    await client.pull("w", routed)
    for _ in range(6):
        g = rng.normal(size=(40, 1)).astype(np.float32)
        # push_pull: the pull that answers one push is the base of the next.
        await client.push_pull("w", routed, g, pull_keys=routed)
    stats = staleness_of(shards, "w")
    assert stats["count"] == 12 and stats["sum"] == 0 and stats["buckets"]["0"] == 12
    assert stats["unknown"] == 0


async def test_interleaved_workers_are_as_stale_as_the_pushes_between(make_clients: MakeClients) -> None:
    table = TableConfig("w", 1, SGD)
    (a, b), shards = await make_clients(table)
    keys = np.arange(1, 51, dtype=np.uint64)
    ra, rb = a.route(keys), b.route(keys)
    await a.pull("w", ra)
    g = np.ones((50, 1), np.float32)
    for _ in range(3):  # b pulls and pushes 3 times while a's gradients age
        await b.pull("w", rb)
        await b.push("w", rb, g)
    await a.push("w", ra, g)
    stats = staleness_of(shards, "w")
    # b: 3 pushes per shard at staleness 0; a's: 3 pushes behind on each shard.
    assert stats["count"] == 8 and stats["buckets"]["0"] == 6 and stats["buckets"]["4"] == 2
    assert stats["sum"] == 6 and stats["down_weighted"] == 0
    # A push with no pull behind it (keys, not a route with clocks) is unknown.
    await a.push("w", keys, g)
    assert staleness_of(shards, "w")["unknown"] == 2


async def test_max_staleness_down_weights_stale_gradients_exactly(make_clients: MakeClients) -> None:
    table = TableConfig("w", 1, SGD, max_staleness=1)
    (a, b), shards = await make_clients(table)
    keys = np.arange(1, 21, dtype=np.uint64)
    ra, rb = a.route(keys), b.route(keys)
    await a.pull("w", ra)
    ones = np.ones((20, 1), np.float32)
    for _ in range(3):
        await b.pull("w", rb)
        await b.push("w", rb, ones)
    before = await b.pull("w", keys)
    await a.push("w", ra, ones * 4)  # 3 pushes stale, bound 1: scaled by (1+1)/(1+3)
    after = await b.pull("w", keys)
    # sgd: w -= lr * g, so the step is 0.5 * 4 * 0.5 = 1.0 per key.
    np.testing.assert_allclose(before - after, np.ones((20, 1)), rtol=1e-6)
    stats = staleness_of(shards, "w")
    assert stats["down_weighted"] == 2 and stats["buckets"]["4"] == 2
    # b's fresh pushes were applied at full weight: 3 steps of 0.5.
    np.testing.assert_allclose(before, np.full((20, 1), -1.5), rtol=1e-6)


async def test_a_retried_push_is_counted_once(make_clients: MakeClients) -> None:
    (client, _), shards = await make_clients(TableConfig("w", 1, SGD))
    keys = np.arange(1, 11, dtype=np.uint64)
    routed = client.route(keys)
    await client.pull("w", routed)
    g = np.ones((10, 1), np.float32)
    await client.push("w", routed, g, request_id=77)
    await client.push("w", routed, g, request_id=77)
    assert staleness_of(shards, "w")["count"] == 2  # one per shard


def test_a_declaration_in_another_mode_is_refused() -> None:
    shard = Shard(ShardSpec(0, 1), (TableConfig("w", 1, SGD),))
    with pytest.raises(ModeConflictError, match="every worker of a model must run the same --mode"):
        shard.declare(TableConfig("w", 1, SGD, mode="geo"))
    with pytest.raises(ModeConflictError, match="max_staleness 4"):
        shard.declare(TableConfig("w", 1, SGD, max_staleness=4))
    assert shard.tables["w"].config.mode == "async"
    assert not shard.declare(TableConfig("w", 1, SGD))  # the same again: accepted, nothing new


def test_geo_tables_hold_weights_only_and_add_the_deltas_pushed() -> None:
    config = TableConfig("w", 2, {"name": "ftrl", "alpha": 0.1}, mode="geo")
    shard = Shard(ShardSpec(0, 1), (config,))
    t = shard.tables["w"]
    assert t.width == 2  # no optimizer slots on a geo shard
    keys = np.array([5, 9], np.uint64)
    d = np.array([[0.25, -1.0], [2.0, 0.5]], np.float32)
    shard.handle_push(Push("w", keys, d))
    shard.handle_push(Push("w", keys[:1], d[:1]))
    np.testing.assert_array_equal(shard.handle_pull("w", keys)[0], np.array([[0.5, -2.0], [2.0, 0.5]], np.float32))
    assert t.staleness.stats()["count"] == 0  # deltas have no staleness
    assert TableConfig.from_dict(config.to_dict()) == config


def test_declarations_validate_the_mode() -> None:
    with pytest.raises(TableConfigError, match="mode 'sometimes'"):
        TableConfig("w", 1, SGD, mode="sometimes")
    with pytest.raises(TableConfigError, match="max_staleness bounds async"):
        TableConfig("w", 1, SGD, mode="geo", max_staleness=2)
    with pytest.raises(TableConfigError, match=r"\[0, 2\*\*31\)"):
        TableConfig("w", 1, SGD, max_staleness=-1)
    # A declaration written before modes existed is async.
    old = {"name": "w", "dim": 1, "optimizer": SGD}
    assert TableConfig.from_dict(old).mode == "async"


async def test_a_mode_conflict_over_http_is_a_409_with_the_reason(serve_shards: Any) -> None:
    _, urls = await serve_shards(2, (TableConfig("w", 1, SGD),))
    control = ControlClient.connect(urls, retry=RetryPolicy(deadline_s=2.0))
    try:
        with pytest.raises(PSError) as err:
            await control.declare(TableConfig("w", 1, SGD, mode="geo"))
        assert err.value.code == "mode_conflict" and err.value.status == 409
        assert "same --mode" in str(err.value)
    finally:
        await control.close()
