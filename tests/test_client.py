"""PSClient over real shard servers on loopback (and over in-process shards).

The client must give exactly the weights one in-process `SparseTable` would
give when fed the same pushes: a key lives on one shard, duplicate gradients
are summed there in the caller's order, and every optimizer step is
elementwise float32, so sharding changes no bit of the result (asserted with
`assert_array_equal`, no tolerance).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from ps_core.checkpoint.control import ControlClient
from ps_core.errors import (
    InvalidValuesError,
    PSError,
    ShardUnavailableError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)
from ps_core.hashing import shard_of
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import create_shard_app
from ps_core.net.transports import TcpTransport
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

LR = TableConfig("lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})
EMB = TableConfig("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1}, init_scale=0.05, seed=7)
TABLES = (LR, EMB)
U64_MAX = 2**64 - 1

MakeClient = Callable[[int, tuple[TableConfig, ...]], Awaitable[tuple[PSClient, ControlClient, list[Shard]]]]


@pytest.fixture(params=["http", "rpc", "local"])
async def make_client(request: pytest.FixtureRequest, serve_shards: Any) -> AsyncIterator[MakeClient]:
    """Builds a client over `n` shards: through HTTP servers, through servers
    that also offer the TCP RPC (pulls and pushes go there), or in process."""
    clients: list[PSClient] = []
    controls: list[ControlClient] = []

    async def make(n: int, tables: tuple[TableConfig, ...] = TABLES) -> tuple[PSClient, ControlClient, list[Shard]]:
        """The data plane's client, the control plane's, and the shards."""
        if request.param in ("http", "rpc"):
            shards, urls = await serve_shards(n, tables, rpc=request.param == "rpc")
            client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=2.0))
            control = ControlClient.connect(urls, retry=RetryPolicy(deadline_s=2.0))
        else:
            shards = [Shard(ShardSpec(i, n), tables) for i in range(n)]
            client, control = PSClient.local(shards), ControlClient.local(shards)
        clients.append(client)
        controls.append(control)
        return client, control, shards

    yield make
    for c in clients:
        # Each remote data call went where the fixture says: the RPC when the
        # shard offers it, HTTP when it does not (None: no data call made).
        used = {t.uses_rpc for t in c.transports if isinstance(t, TcpTransport)} - {None}
        assert used <= ({True} if request.param == "rpc" else {False})
        await c.close()
    for control in controls:
        await control.close()


def key_pool(rng: np.random.Generator, size: int = 30) -> np.ndarray:
    pool = np.concatenate([np.array([0, U64_MAX], np.uint64), rng.integers(1, U64_MAX, size, dtype=np.uint64)])
    assert set(shard_of(pool, 2).tolist()) == {0, 1}
    return pool


async def run_random_sequence(client: PSClient, seed: int, steps: int = 80) -> list[np.ndarray]:
    """Random pulls and pushes checked step by step against reference tables;
    returns every pull result (and a final pull of the whole key pool)."""
    rng = np.random.default_rng(seed)
    refs = {c.name: SparseTable(c) for c in TABLES}
    pool = key_pool(rng)
    pulls: list[np.ndarray] = []
    batches_with_duplicates = 0
    for _ in range(steps):
        cfg = TABLES[int(rng.integers(2))]
        n = int(rng.integers(0, 25))
        keys = rng.choice(pool, n)
        batches_with_duplicates += int(np.unique(keys).size < n)
        if rng.random() < 0.4:
            got = await client.pull(cfg.name, keys)
            assert got.shape == (n, cfg.dim) and got.dtype == np.float32
            np.testing.assert_array_equal(got, refs[cfg.name].pull(keys))
            pulls.append(got)
        else:
            grads = (rng.standard_normal((n, cfg.dim)) * 2).astype(np.float32)
            counts = rng.integers(0, 3, (n, 2)).astype(np.float32) if rng.random() < 0.5 else None
            applied = await client.push(cfg.name, keys, grads, counts=counts, event_time=1e9)
            assert applied == refs[cfg.name].push(keys, grads, counts=counts, event_time=1e9)
    assert batches_with_duplicates > 5  # the sequence did exercise duplicate keys
    for cfg in TABLES:
        got = await client.pull(cfg.name, pool)
        np.testing.assert_array_equal(got, refs[cfg.name].pull(pool))
        assert np.count_nonzero(got) > 0
        pulls.append(got)
    return pulls


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_pull_push_equals_one_reference_table(make_client: MakeClient, seed: int) -> None:
    client, _, shards = await make_client(2, TABLES)
    await run_random_sequence(client, seed)
    # Each shard holds only the keys it owns.
    for shard in shards:
        for t in shard.tables.values():
            live = t.index.row_keys[: t.index.num_rows][t.index.row_live[: t.index.num_rows]]
            assert live.size > 0
            assert (shard_of(live, 2) == shard.spec.shard_id).all()


async def test_local_and_http_clients_give_identical_results(serve_shards: Any) -> None:
    _, urls = await serve_shards(2, TABLES)
    local_shards = [Shard(ShardSpec(i, 2), TABLES) for i in range(2)]
    async with (
        PSClient.connect(urls) as http_client,
        PSClient.local(local_shards) as local,
        ControlClient.connect(urls) as http_control,
    ):
        via_http = await run_random_sequence(http_client, seed=3)
        via_local = await run_random_sequence(local, seed=3)
        assert len(via_http) == len(via_local)
        for a, b in zip(via_http, via_local):
            np.testing.assert_array_equal(a, b)
        http_stats, local_stats = await http_control.stats(), await ControlClient.local(local_shards).stats()
    for h, loc in zip(http_stats, local_stats):
        for name in ("lr", "emb"):
            assert h.tables[name].features == loc.tables[name].features
            assert h.tables[name].pushes == loc.tables[name].pushes


@pytest.mark.parametrize("num_shards", [1, 2, 3])
async def test_pull_answers_in_the_callers_order(make_client: MakeClient, num_shards: int) -> None:
    sgd = TableConfig("w", dim=2, optimizer={"name": "sgd", "lr": 1.0})
    client, _, _ = await make_client(num_shards, (sgd,))
    keys = np.array([U64_MAX, 0, *range(100, 120)], dtype=np.uint64)
    # SGD with lr 1 from zero: a key's weights are minus its gradient.
    grads = np.stack([np.arange(keys.size), -np.arange(keys.size) * 0.5], axis=1).astype(np.float32)
    assert await client.push("w", keys, grads) == keys.size

    rng = np.random.default_rng(0)
    pick = rng.integers(0, keys.size, 60)  # shuffled, with repeats, mixing shards
    if num_shards > 1:
        assert len(set(shard_of(keys[pick], num_shards).tolist())) == num_shards
    got = await client.pull("w", keys[pick])
    np.testing.assert_array_equal(got, -grads[pick])
    assert got.flags.writeable  # the caller owns the result


@pytest.mark.parametrize("num_shards", [1, 2])
async def test_empty_batches(make_client: MakeClient, num_shards: int) -> None:
    client, _, shards = await make_client(num_shards, TABLES)
    for cfg in TABLES:
        got = await client.pull(cfg.name, np.zeros(0, np.uint64))
        assert got.shape == (0, cfg.dim) and got.dtype == np.float32
        assert await client.push(cfg.name, [], np.zeros((0, cfg.dim), np.float32)) == 0
    assert all(len(t) == 0 for s in shards for t in s.tables.values())


async def test_declare_is_idempotent_and_conflicts_are_typed(make_client: MakeClient) -> None:
    client, control, shards = await make_client(2, ())
    fm = TableConfig("fm", dim=8, optimizer={"name": "adagrad"}, init_scale=0.01)
    assert await control.declare(fm) is True
    assert await control.declare(fm) is False
    assert all(s.tables["fm"].config == fm for s in shards)

    conflicting = TableConfig("fm", dim=4, optimizer={"name": "adagrad"}, init_scale=0.01)
    with pytest.raises(TableConflictError, match="table fm exists with"):
        await control.declare(conflicting)
    assert all(s.tables["fm"].dim == 8 for s in shards)
    assert (await client.pull("fm", [1, 2, 3])).shape == (3, 8)


async def test_unknown_table_is_a_typed_error(make_client: MakeClient) -> None:
    client, _, _ = await make_client(2, TABLES)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(UnknownTableError, match="no table 'nope'"):
        await client.pull("nope", [1, 2, 3])
    with pytest.raises(UnknownTableError):
        await client.push("nope", [1, 2, 3], [1.0, 2.0, 3.0])
    with pytest.raises(UnknownTableError):
        await client.pull("nope", [])
    assert loop.time() - start < 1.0  # answered, not retried until the deadline


async def test_invalid_values_are_typed_and_apply_nothing(make_client: MakeClient) -> None:
    client, _, shards = await make_client(2, TABLES)
    keys = np.arange(20, dtype=np.uint64)
    grads = np.ones(20, np.float32)
    grads[7] = np.nan
    with pytest.raises(InvalidValuesError, match="NaN or inf"):
        await client.push("lr", keys, grads)
    with pytest.raises(InvalidValuesError, match="has dim 4, the push carries dim 2"):
        await client.push("emb", keys, np.ones((20, 2), np.float32))
    with pytest.raises(ValueError, match="20 keys but 19 gradient rows"):
        await client.push("lr", keys, np.ones(19, np.float32))
    # The shard without the NaN key may have applied its part; the NaN one did not.
    bad_owner = int(shard_of(keys[7:8], 2)[0])
    assert len(shards[bad_owner].tables["lr"]) == 0
    assert len(shards[bad_owner].tables["emb"]) == 0


async def test_a_local_client_skips_ownership_checks_only_where_its_routing_is_the_shards() -> None:
    keys = np.arange(200, dtype=np.uint64)
    shards = [Shard(ShardSpec(i, 2), TABLES) for i in range(2)]
    async with PSClient.local(shards) as client:
        assert [t.routed for t in client.transports] == [True, True]  # type: ignore[attr-defined]
        await client.push("lr", keys, np.ones((keys.size, 1), dtype=np.float32))
    for i, s in enumerate(shards):
        assert len(s.tables["lr"]) == int((shard_of(keys, 2) == i).sum())
    # Shard 0 of 2 as if it were alone: the client sends it every key, and it
    # checks them and refuses the other shard's, as a shard server does.
    theirs = keys[shard_of(keys, 2) == 1]
    async with PSClient.local(shards[:1]) as alone:
        assert [t.routed for t in alone.transports] == [False]  # type: ignore[attr-defined]
        with pytest.raises(WrongShardError):
            await alone.pull("lr", theirs)
        with pytest.raises(WrongShardError):
            await alone.push("lr", theirs, np.ones((theirs.size, 1), dtype=np.float32))
        with pytest.raises(WrongShardError):
            await alone.push_pull("lr", theirs[:0], np.ones((0, 1), dtype=np.float32), pull_keys=theirs)


async def test_client_with_the_wrong_shard_count_gets_wrong_shard(serve_shards: Any) -> None:
    _, urls = await serve_shards(2, TABLES)
    keys = np.arange(50, dtype=np.uint64)
    theirs = keys[shard_of(keys, 2) == 1]
    async with PSClient.connect(urls[:1]) as client:  # believes there is one shard
        with pytest.raises(WrongShardError, match="not shard 0 of 2"):
            await client.pull("lr", theirs)


# -- unavailable shards -------------------------------------------------------------


def both_shard_keys() -> np.ndarray:
    keys = np.arange(40, dtype=np.uint64)
    assert set(shard_of(keys, 2).tolist()) == {0, 1}
    return keys


@pytest.mark.slow
async def test_stopped_shard_raises_shard_unavailable_naming_it(serve_shards: Any) -> None:
    _, urls = await serve_shards(2, TABLES)
    keys = both_shard_keys()
    deadline = 1.0
    loop = asyncio.get_running_loop()
    async with PSClient.connect(urls, retry=RetryPolicy(deadline_s=deadline)) as client:
        await client.push("lr", keys, np.ones(keys.size, np.float32))  # connections now open
        await serve_shards.runners[1].cleanup()

        for call in (
            lambda: client.pull("lr", keys),
            lambda: client.push("lr", keys, np.ones(keys.size, np.float32)),
        ):
            start = loop.time()
            with pytest.raises(ShardUnavailableError) as info:
                await call()
            elapsed = loop.time() - start
            err = info.value
            assert err.shard_id == 1 and err.url == urls[1]
            # Refused, not silent: how long since the first attempt, and the last error.
            assert f"shard 1 at {urls[1]} unreachable for " in str(err) and "; last: " in str(err), str(err)
            assert float(str(err).split("unreachable for ")[1].split("s")[0]) >= 0.5, str(err)
            assert err.retriable and err.code == "shard_unavailable"
            # Retried with backoff for a good part of the deadline, not forever.
            # (That it gives up *before* the deadline is a bug: see below.)
            assert 0.5 <= elapsed < deadline + 1.0, elapsed

        # Shard 0 alone still answers for its own keys.
        mine = keys[shard_of(keys, 2) == 0]
        assert (await client.pull("lr", mine)).shape == (mine.size, 1)


async def test_shard_unavailable_only_after_the_full_deadline(serve_shards: Any) -> None:
    _, urls = await serve_shards(2, TABLES)
    deadline = 1.0
    loop = asyncio.get_running_loop()
    async with PSClient.connect(urls, retry=RetryPolicy(deadline_s=deadline)) as client:
        await serve_shards.runners[1].cleanup()
        start = loop.time()
        with pytest.raises(ShardUnavailableError):
            await client.pull("lr", both_shard_keys())
        elapsed = loop.time() - start
    assert elapsed >= 0.95 * deadline, f"gave up after {elapsed:.2f}s of a {deadline}s deadline"


async def test_shard_back_before_the_deadline_is_transparent(serve_shards: Any) -> None:
    shards, urls = await serve_shards(2, TABLES)
    port = int(urls[1].rsplit(":", 1)[1])
    keys = both_shard_keys()
    ref = SparseTable(LR)
    outage_s = 0.3
    loop = asyncio.get_running_loop()

    async def restart_shard_1_after_outage() -> None:
        await asyncio.sleep(outage_s)  # the simulated outage, not a wait for readiness
        runner = web.AppRunner(create_shard_app(shards[1]), access_log=None)
        await runner.setup()
        serve_shards.runners.append(runner)  # stopped at fixture teardown
        await web.TCPSite(runner, "127.0.0.1", port).start()

    async with PSClient.connect(urls, retry=RetryPolicy(deadline_s=5.0)) as client:
        grads = np.linspace(-3, 3, keys.size, dtype=np.float32)
        await client.push("lr", keys, grads)
        ref.push(keys, grads)
        await serve_shards.runners[1].cleanup()

        restart = asyncio.create_task(restart_shard_1_after_outage())
        start = loop.time()
        applied = await client.push("lr", keys, grads)  # spans the outage
        elapsed = loop.time() - start
        await asyncio.wait_for(restart, timeout=5.0)
        ref.push(keys, grads)
        assert applied == keys.size
        assert outage_s * 0.8 <= elapsed < 5.0, elapsed

        # Applied exactly once on each shard despite the retries.
        np.testing.assert_array_equal(await client.pull("lr", keys), ref.pull(keys))
        assert shards[1].tables["lr"].pushes == 2


async def test_client_needs_shards_in_order() -> None:
    # Both planes' clients check the same way.
    for make in (PSClient.local, ControlClient.local):
        with pytest.raises(ValueError, match="at least one shard"):
            make([])
        with pytest.raises(ValueError, match="shards 0..1 in order"):
            make([Shard(ShardSpec(1, 2)), Shard(ShardSpec(0, 2))])


async def test_errors_are_ps_errors(make_client: MakeClient) -> None:
    client, _, _ = await make_client(1, TABLES)
    with pytest.raises(PSError) as info:
        await client.pull("missing", [1])
    assert info.value.status == 404


async def test_counts_row_mismatch_names_the_counts() -> None:
    client = PSClient.local([Shard(ShardSpec(0, 1), TABLES)])
    with pytest.raises(ValueError, match="counts"):
        await client.push("lr", [1, 2, 3], [1.0, 2.0, 3.0], counts=[[1, 0], [1, 0]])


@pytest.mark.parametrize("num_shards", [1, 3])
async def test_a_routed_batch_pulls_and_pushes_like_plain_keys(make_client: MakeClient, num_shards: int) -> None:
    sgd = TableConfig("w", dim=2, optimizer={"name": "sgd", "lr": 1.0})
    client, _, _ = await make_client(num_shards, (sgd,))
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64, 500, dtype=np.uint64)
    grads = rng.normal(size=(500, 2)).astype(np.float32)
    routed = client.route(keys)
    assert await client.push("w", routed, grads) == 500
    np.testing.assert_array_equal(await client.pull("w", routed), -grads)
    np.testing.assert_array_equal(await client.pull("w", keys), -grads)
    # The same routing serves a second push (the worker's pull-then-push step).
    await client.push("w", routed, grads, counts=np.ones((500, 2), dtype=np.float32))
    np.testing.assert_allclose(await client.pull("w", keys[::-1]), -2 * grads[::-1])


# -- push_pull: one request per shard for a mini-batch's push and the next pull -----


async def test_push_pull_loop_equals_one_reference_table(make_client: MakeClient) -> None:
    """The worker loop: push mini-batch i and pull mini-batch i+1 in one call,
    each routed once; every answer equals push-then-pull on one table."""
    client, _, shards = await make_client(2, TABLES)
    rng = np.random.default_rng(21)
    refs = {c.name: SparseTable(c) for c in TABLES}
    pool = key_pool(rng, 60)
    for cfg in TABLES:
        prev = client.route(np.zeros(0, np.uint64))
        for step in range(15):
            nxt = client.route(rng.choice(pool, int(rng.integers(0, 40))))  # may be empty, repeats
            n = prev.keys.size
            grads = (rng.standard_normal((n, cfg.dim)) * 2).astype(np.float32)
            counts = rng.integers(0, 3, (n, 2)).astype(np.float32) if step % 2 else None
            applied, weights = await client.push_pull(
                cfg.name, prev, grads, pull_keys=nxt, counts=counts, event_time=1e9 + step
            )
            ref = refs[cfg.name]
            assert applied == ref.push(prev.keys, grads, counts=counts, event_time=1e9 + step)
            assert weights.shape == (nxt.keys.size, cfg.dim) and weights.dtype == np.float32
            assert weights.flags.writeable  # the caller owns the result
            np.testing.assert_array_equal(weights, ref.pull(nxt.keys))
            prev = nxt
        np.testing.assert_array_equal(await client.pull(cfg.name, pool), refs[cfg.name].pull(pool))
    for shard in shards:
        for name, t in shard.tables.items():
            assert len(t) > 0, name
            live = t.index.row_keys[: t.index.num_rows][t.index.row_live[: t.index.num_rows]]
            assert (shard_of(live, 2) == shard.spec.shard_id).all()


def count_calls(client: PSClient) -> dict[str, list[int]]:
    """Wrap every transport's pull, push and push_pull to record which shard
    each call went to."""
    calls: dict[str, list[int]] = {"pull": [], "push": [], "push_pull": []}
    for t in client.transports:
        for name in calls:
            inner = getattr(t, name)

            async def wrapped(*a: Any, _inner: Any = inner, _name: str = name, _id: int = t.shard_id) -> Any:
                calls[_name].append(_id)
                return await _inner(*a)

            setattr(t, name, wrapped)
    return calls


async def test_push_pull_sends_one_request_per_shard_with_anything(make_client: MakeClient) -> None:
    sgd = TableConfig("w", dim=2, optimizer={"name": "sgd", "lr": 1.0})
    client, _, shards = await make_client(3, (sgd,))
    keys = np.arange(300, dtype=np.uint64)
    owner = shard_of(keys, 3)
    on0, on1 = keys[owner == 0][:20], keys[owner == 1][:30]
    calls = count_calls(client)
    grads = np.stack([np.arange(20), np.ones(20)], axis=1).astype(np.float32)
    # Push only to shard 0, pull only from shard 1, nothing for shard 2.
    applied, w = await client.push_pull("w", on0, grads, pull_keys=on1)
    assert applied == 20 and w.shape == (30, 2) and not w.any()
    assert calls == {"pull": [], "push": [], "push_pull": [0, 1]}
    # Now the reverse direction sees the push (SGD lr 1 from zero: w = -grad).
    applied, w = await client.push_pull("w", on1[:0], np.zeros((0, 2), np.float32), pull_keys=on0[::-1])
    assert applied == 0
    np.testing.assert_array_equal(w, -grads[::-1])
    assert calls["push_pull"] == [0, 1, 0]
    assert shards[2].tables["w"].pushes == shards[2].tables["w"].pulls == 0
    # Nothing at all still asks shard 0 once, for the dim.
    applied, w = await client.push_pull("w", [], [], pull_keys=[])
    assert (applied, w.shape) == (0, (0, 2))
    assert calls["push_pull"] == [0, 1, 0, 0]


async def test_push_pull_with_a_repeated_request_id_applies_once(make_client: MakeClient) -> None:
    client, _, shards = await make_client(2, TABLES)
    keys = both_shard_keys()
    grads = np.linspace(-1, 1, keys.size, dtype=np.float32)
    ref = SparseTable(LR)
    ref.push(keys, grads)
    rid = client.new_request_id()
    first = await client.push_pull("lr", keys, grads, pull_keys=keys[::-1], request_id=rid)
    again = await client.push_pull("lr", keys, grads, pull_keys=keys[::-1], request_id=rid)
    assert first[0] == again[0] == keys.size  # the earlier count, acknowledged again
    for _, w in (first, again):
        np.testing.assert_array_equal(w, ref.pull(keys[::-1]))
    assert [s.duplicate_pushes for s in shards] == [1, 1]
    assert [s.tables["lr"].pushes for s in shards] == [1, 1]


async def test_push_pull_errors_are_typed_and_apply_nothing(make_client: MakeClient) -> None:
    client, _, shards = await make_client(2, TABLES)
    keys = both_shard_keys()
    grads = np.ones(keys.size, np.float32)
    grads[7] = np.nan
    with pytest.raises(InvalidValuesError, match="NaN or inf"):
        await client.push_pull("lr", keys, grads, pull_keys=keys)
    bad_owner = int(shard_of(keys[7:8], 2)[0])
    assert len(shards[bad_owner].tables["lr"]) == 0
    assert shards[bad_owner].tables["lr"].pulls == 0  # the pull was not answered either
    with pytest.raises(UnknownTableError):
        await client.push_pull("nope", keys, np.ones(keys.size, np.float32), pull_keys=keys)
    with pytest.raises(ValueError, match="40 keys but 39 gradient rows"):
        await client.push_pull("lr", keys, np.ones(39, np.float32), pull_keys=keys)
    with pytest.raises(ValueError, match="counts"):
        await client.push_pull("lr", keys, np.ones(40, np.float32), pull_keys=keys, counts=np.ones((3, 2)))
    other = PSClient.local([Shard(ShardSpec(i, 3), TABLES) for i in range(3)])
    with pytest.raises(ValueError, match="pull_keys were routed for 3 shards, this client has 2"):
        await client.push_pull("lr", [], [], pull_keys=other.route(keys))


async def test_push_pull_retried_after_a_lost_reply_is_applied_once(serve_shards: Any) -> None:
    """Shard 1 applies the first push_pull it gets, then answers 503 as a
    proxy losing the reply would; the client retries with the same body, and
    the shard answers the pull without applying the push again."""
    shards, urls = await serve_shards(2, TABLES)
    await serve_shards.runners[1].cleanup()
    port = int(urls[1].rsplit(":", 1)[1])
    lost: list[int] = []

    @web.middleware
    async def lose_first_reply(request: web.Request, handler: Any) -> web.StreamResponse:
        resp: web.StreamResponse = await handler(request)
        if request.path == "/v1/push_pull" and not lost:
            lost.append(resp.status)
            return web.Response(status=503, text="reply lost")
        return resp

    app = create_shard_app(shards[1])
    app.middlewares.append(lose_first_reply)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    serve_shards.runners.append(runner)
    await web.TCPSite(runner, "127.0.0.1", port).start()

    keys = both_shard_keys()
    grads = np.linspace(-2, 2, keys.size, dtype=np.float32)
    ref = SparseTable(LR)
    ref.push(keys, grads)
    async with PSClient.connect(urls, retry=RetryPolicy(deadline_s=5.0)) as client:
        applied, w = await client.push_pull("lr", keys, grads, pull_keys=keys[::-1])
    assert lost == [200]  # the first attempt was applied, its reply dropped
    assert applied == keys.size
    np.testing.assert_array_equal(w, ref.pull(keys[::-1]))
    assert shards[1].duplicate_pushes == 1 and shards[1].tables["lr"].pushes == 1
    assert shards[0].duplicate_pushes == 0 and shards[0].tables["lr"].pushes == 1
