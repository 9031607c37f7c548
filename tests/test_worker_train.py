"""The worker's training loop (push of one mini-batch and pull of the next in
one request) against a plain pull → predict → push reference; with several
mini-batches in flight (``--in-flight``), against one at a time, within the
model's staleness bound, and through a far shard (`delay_proxy`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from consumer_side import Consumer, Letters
from delay_proxy import DelayProxy, through
from training import window_of
from waiting import until

from consumers.decode import Decoded, decode_records
from consumers.pipeline import ModelGoneError
from consumers.training import AsyncTraining, mini_batches
from consumers.windows import Window, WindowBuilder
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.batch import EventBatch
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.metrics import Metrics, evaluate
from ps_core.model.models import FactorizationMachine, LogisticRegression, Model, sigmoid
from ps_core.model.ramp import MiniBatchRamp
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.store.staleness import BUCKETS
from ps_core.synthetic import SyntheticStream


async def _train(worker: Worker, decoded: Decoded, window: Window) -> Metrics:
    """The worker's training of one decoded batch, as one piece."""

    async def one() -> AsyncIterator[EventBatch]:
        yield decoded.batch

    return await worker.training.train(one(), window)


def _local_worker(in_flight: int = 1, mini_batch: int = 256) -> tuple[Worker, Shard]:
    """A worker of a logistic regression "m", and the one in-process shard
    that holds its tables (no broker: the tests hand the worker windows)."""
    model = LogisticRegression("m")
    shard = Shard(ShardSpec(0, 1))
    for t in model.tables():
        shard.declare(t)
    config = WorkerConfig("unused:9092", decode_processes=0, in_flight=in_flight, mini_batch=mini_batch)
    worker = Worker(config, PSClient.local([shard]), ControlClient.local([shard]), model)
    return worker, shard


async def _reference(client: PSClient, model: Model, values: list[bytes | None], sizes: MiniBatchRamp) -> np.ndarray:
    batch = decode_records(values, model.name, 1 << 20).batch
    out = np.empty(batch.size)
    start = 0
    while start < batch.size:  # mini-batches of the sizes the ramp gives, each pulled then pushed
        sub = batch.slice(start, min(start + sizes.next_size(start), batch.size))
        plan = model.plan(sub)
        weights = {t: await client.pull(t, plan.keys) for t in model.table_names}
        p = sigmoid(model.logits(sub, plan, weights))
        out[start : start + sub.size] = p
        grads = model.gradients(sub, plan, weights, (p - sub.labels) * sub.weights)
        ts = sub.ts[np.isfinite(sub.ts)]
        for t, g in grads.items():
            await client.push(t, plan.keys, g, counts=plan.counts(sub.labels), event_time=float(ts.max()))
        start += sub.size
    return out


@pytest.mark.parametrize(("shards", "ramp"), [(1, 0), (2, 0), (2, 4)])
@pytest.mark.parametrize("kind", ["lr", "fm"])
async def test_pipelined_training_matches_pull_then_push(shards: int, kind: str, ramp: int) -> None:
    events = SyntheticStream(seed=3).batch(1000)
    values: list[bytes | None] = [orjson.dumps(e) for e in events]
    step = 96  # 1000 events: ten full mini-batches and a short last one (without a ramp)
    # With a ramp of 4: mini-batches of 1 event, growing to 96 after 384 events.
    sizes = MiniBatchRamp(step, ramp)

    def make() -> tuple[PSClient, ControlClient, Model]:
        model: Model = LogisticRegression("m") if kind == "lr" else FactorizationMachine("m", k=4)
        local = [Shard(ShardSpec(i, shards)) for i in range(shards)]
        for s in local:
            for t in model.tables():
                s.declare(t)
        return PSClient.local(local), ControlClient.local(local), model

    ref_client, _, ref_model = make()
    expected = await _reference(ref_client, ref_model, values, sizes)

    client, control, model = make()
    config = WorkerConfig("unused:9092", mini_batch=step, mini_batch_ramp=ramp, decode_processes=0)
    worker = Worker(config, client, control, model)
    decoded = decode_records(values, model.name, 1 << 20)
    metrics = await _train(worker, decoded, window_of(values))

    assert metrics.events == len(events)
    assert worker.stats.events_trained == len(events)
    # ...and the same progressive predictions: pipelining changed no read's view of the model.
    # The same final weights...
    probe = decoded.batch.slice(0, 50)
    keys = model.plan(probe).keys
    for t in model.table_names:
        np.testing.assert_allclose(await client.pull(t, keys), await ref_client.pull(t, keys), rtol=1e-6, atol=1e-7)
    want = evaluate(expected, decoded.batch.labels)
    assert metrics.logloss == pytest.approx(want.logloss, rel=1e-9)
    assert metrics.auc == pytest.approx(want.auc, rel=1e-9)


async def test_a_window_of_only_rejected_records_trains_nothing() -> None:
    worker, shard = _local_worker()
    values: list[bytes | None] = [b"not json", b'{"features": {}}']
    decoded = decode_records(values, worker.model.name, 1 << 20)
    assert decoded.batch.size == 0 and len(decoded.rejected) == 2
    metrics = await _train(worker, decoded, window_of(values))
    assert metrics.events == 0 and worker.stats.events_trained == 0
    assert shard.tables["m_w"].pushes == 0 and shard.tables["m_w"].pulls == 0


async def _as_pieces(batches: list[EventBatch]) -> AsyncIterator[EventBatch]:
    for b in batches:
        yield b


@pytest.mark.parametrize("ramp", [0, 4])
@pytest.mark.parametrize("sizes", [[137, 0, 400, 463], [1000], [96, 96, 808], [5] * 200])
async def test_chunks_train_exactly_as_their_concatenation(sizes: list[int], ramp: int) -> None:
    """A window's chunks, decoded separately and trained as they arrive, give
    the same mini-batches, predictions and weights as the whole window at
    once: a mini-batch takes the end of one chunk and the start of the next."""
    events = SyntheticStream(seed=5).batch(1000)
    values: list[bytes | None] = [orjson.dumps(e) for e in events]
    step = 96

    def make() -> tuple[Worker, PSClient, Model]:
        model: Model = LogisticRegression("m")
        shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
        for s in shards:
            for t in model.tables():
                s.declare(t)
        client, control = PSClient.local(shards), ControlClient.local(shards)
        return (
            Worker(
                WorkerConfig("unused:9092", mini_batch=step, mini_batch_ramp=ramp, decode_processes=0),
                client,
                control,
                model,
            ),
            client,
            model,
        )

    whole_worker, whole_client, model = make()
    whole = decode_records(values, model.name, 1 << 20)
    expected = await _train(whole_worker, whole, window_of(values))

    bounds = np.cumsum([0] + sizes)
    parts = [decode_records(values[a:b], model.name, 1 << 20).batch for a, b in zip(bounds[:-1], bounds[1:])]
    worker, client, _ = make()
    ramped = MiniBatchRamp(step, ramp)
    got_sizes = [b.size async for b in mini_batches(_as_pieces(parts), ramped.next_size)]
    want_sizes, done = [], 0
    while done < 1000:
        want_sizes.append(min(ramped.next_size(done), 1000 - done))
        done += want_sizes[-1]
    assert got_sizes == want_sizes
    if ramp == 0:
        assert got_sizes == [step] * (1000 // step) + [1000 % step]
    else:
        assert got_sizes[:3] == [1, 1, 1] and max(got_sizes) == step
    metrics = await worker.training.train(_as_pieces(parts), window_of(values))

    assert metrics == expected
    keys = model.plan(whole.batch).keys
    for t in model.table_names:
        np.testing.assert_array_equal(await client.pull(t, keys), await whole_client.pull(t, keys))


async def test_a_window_trains_only_the_partitions_still_owned() -> None:
    """Chunks of partitions 0 and 1 in one window, partition 1 revoked after
    it closed: only partition 0's good events train, only its bad record is
    dead-lettered (with its own offset), only its offset is committed."""
    good = [orjson.dumps(e) for e in SyntheticStream(seed=9).batch(12)]
    p0a: list[bytes | None] = [*good[:5], b"{broken"]
    p1: list[bytes | None] = [*good[5:9], b"[1, 2"]
    p0b: list[bytes | None] = good[9:12]
    builder = WindowBuilder(within_s=3600, max_events=100)
    for part, values, first in ((0, p0a, 0), (1, p1, 0), (0, p0b, 6)):
        records = [
            ConsumerRecord("clicks", part, first + i, 1_700_000_000_000, 0, None, v, None, -1, len(v or b""), ())
            for i, v in enumerate(values)
        ]
        builder.add(records)
    window = builder.take()
    assert window is not None

    worker, shard = _local_worker()
    consumer = Consumer({TopicPartition("clicks", 0)})
    letters = Letters()
    worker._consumer, worker._dlq = consumer, letters  # type: ignore[assignment]
    chunks = [(("clicks", part), len(v), worker._decode(v)) for part, v in ((0, p0a), (1, p1), (0, p0b))]
    await worker._apply(window, chunks)

    assert worker.stats.events_trained == 8
    table = shard.tables["m_w"]
    bias = np.array([FeatureHasher("m").bias_key], dtype=np.uint64)
    assert int(table.shows[table.index.lookup(bias)][0]) == 8  # the bias is shown once per event
    assert [(d.reason, d.partition, d.offset) for d in letters.sent] == [("invalid_json", 0, 5)]
    assert consumer.commits == [{TopicPartition("clicks", 0): 9}]
    assert worker.stats.last is not None and worker.stats.last.events == 8 and worker.stats.last.dlq == 1


def _bias_shows(shards: list[Shard], table: str, name: str) -> int:
    """The bias row's shows, on whichever shard holds it."""
    bias = np.array([FeatureHasher(name).bias_key], dtype=np.uint64)
    total = 0
    for s in shards:
        t = s.tables[table]
        row = int(t.index.lookup(bias)[0])
        total += int(t.shows[row]) if row >= 0 else 0
    return total


async def _windows(worker: Worker, values: list[bytes | None], per_window: int) -> list[Metrics]:
    """`values` trained as consecutive windows of `per_window` records."""
    out = []
    for start in range(0, len(values), per_window):
        part = values[start : start + per_window]
        out.append(await _train(worker, decode_records(part, worker.model.name, 1 << 20), window_of(part)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [2, 4])
async def test_mini_batches_in_flight_train_every_event_once_and_learn_as_one_at_a_time(
    serve_shards: Any, in_flight: int
) -> None:
    """Over the RPC of 2 shards: D mini-batches in flight train each event
    once (the bias row shows every event), learn the synthetic stream as well
    as one at a time, and their own pushes are exactly D - 1 stale."""
    one, many = LogisticRegression("one"), LogisticRegression("many")
    shards, urls = await serve_shards(2, (*one.tables(), *many.tables()), rpc=True)
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=11).batch(6000)]
    metrics = {}
    for model, d in ((one, 1), (many, in_flight)):
        async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
            # A ramp, as a fresh model's worker has: D pushes of a big
            # mini-batch's bias gradient, each computed from the same
            # weights, would overshoot (docs/guide/worker.md).
            config = WorkerConfig("unused:9092", decode_processes=0, mini_batch=64, mini_batch_ramp=256, in_flight=d)
            worker = Worker(config, client, control, model)
            got = await _windows(worker, values, 2000)
        assert sum(m.events for m in got) == worker.stats.events_trained == 6000
        assert _bias_shows(shards, f"{model.name}_w", model.name) == 6000
        metrics[d] = evaluate_all(got)
    assert abs(metrics[in_flight][0] - metrics[1][0]) < 0.005  # progressive log loss (about 0.27)
    assert abs(metrics[in_flight][1] - metrics[1][1]) < 0.01  # progressive AUC
    stale = [s.tables["many_w"].staleness.stats() for s in shards]
    assert all(st["unknown"] == 0 and st["down_weighted"] == 0 for st in stale)
    # Push k is the D - 1 pushes between its pull and it behind (fewer for
    # a window's first D - 1 and a shard some mini-batch missed): the bucket
    # of D - 1 is the stalest one used.
    worst = max(int(b) for st in stale for b, c in st["buckets"].items() if c and b != "+Inf")
    assert worst == min(b for b in BUCKETS if b >= in_flight - 1)
    assert 0 < sum(st["sum"] for st in stale) <= (in_flight - 1) * sum(st["count"] for st in stale)
    one_at_a_time = [s.tables["one_w"].staleness.stats() for s in shards]
    assert sum(st["sum"] for st in one_at_a_time) == 0
    # The same mini-batches, each pushed once to each shard it touches.
    assert sum(st["count"] for st in stale) == sum(st["count"] for st in one_at_a_time)


def evaluate_all(windows: list[Metrics]) -> tuple[float, float]:
    """Mean progressive log loss and AUC over windows (each weighted by its events)."""
    n = sum(m.events for m in windows)
    return (
        sum(m.logloss * m.events for m in windows) / n,
        sum(m.auc * m.events for m in windows) / n,
    )


@pytest.mark.parametrize(("bound", "depth"), [(0, 1), (1, 2), (3, 4)])
async def test_in_flight_is_capped_by_the_models_max_staleness(
    bound: int, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    """--in-flight 8 on a model declared with max_staleness N runs N + 1 in
    flight (and says so): no push of the worker's own is staler than N, none
    down-weighted; at the cap some are exactly N stale."""
    model = LogisticRegression("m", max_staleness=bound)
    shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
    config = WorkerConfig("unused:9092", decode_processes=0, mini_batch=32, mini_batch_ramp=0, in_flight=8)
    with caplog.at_level(logging.WARNING, logger="ctrps.worker"):
        worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), model)
    training = worker.training
    assert isinstance(training, AsyncTraining) and training.depth == depth
    assert f"in-flight 8 capped to {depth}" in caplog.text and f"max_staleness {bound}" in caplog.text
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=4).batch(1000)]
    await _windows(worker, values, 500)
    stale = [s.tables["m_w"].staleness.stats() for s in shards]
    assert sum(st["down_weighted"] for st in stale) == 0  # the shards' own count of pushes staler than the bound
    seen = {int(b) for st in stale for b, c in st["buckets"].items() if c and b != "+Inf"}
    assert max(seen) == min(b for b in BUCKETS if b >= bound)  # some push as stale as allowed
    assert sum(st["sum"] for st in stale) <= bound * sum(st["count"] for st in stale)


@pytest.mark.parametrize("in_flight", [1, 4])
async def test_a_push_failing_part_way_fails_the_window_as_one_at_a_time(in_flight: int) -> None:
    """The model's table dropped after some of a window's pushes: the window
    fails with the error one mini-batch at a time gives (the model is gone),
    nothing is committed or dead-lettered, and no push is left running."""
    worker, shard = _local_worker(in_flight=in_flight, mini_batch=50)
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=2).batch(800)]
    consumer, letters = Consumer({TopicPartition("clicks", 0)}), Letters()
    worker._consumer, worker._dlq = consumer, letters  # type: ignore[assignment]
    second: asyncio.Future[Decoded] = asyncio.get_running_loop().create_future()
    chunks = [(("clicks", 0), 400, worker._decode(values[:400])), (("clicks", 0), 400, second)]
    before = asyncio.all_tasks()

    async def drop_part_way() -> None:
        await until(lambda: shard.tables["m_w"].pushes >= 2, what="the window's first pushes")
        assert shard.drop("m_w")
        second.set_result(decode_records(values[400:], "m", 1 << 20))

    dropping = asyncio.create_task(drop_part_way())
    with pytest.raises(ModelGoneError):
        await worker._apply(window_of(values), chunks)
    await dropping
    assert consumer.commits == [] and letters.sent == []
    assert asyncio.all_tasks() <= before  # nothing of the window still running


@pytest.mark.slow
async def test_a_far_shard_takes_fewer_round_trips_with_mini_batches_in_flight(serve_shards: Any) -> None:
    """Through a proxy delaying each way by 20 ms: one mini-batch at a time
    sets out on an idle link once per mini-batch; four in flight keep the
    link busy and set out on it about a quarter as often, training the same
    events (counts of round trips, not timings)."""
    one, many = LogisticRegression("one"), LogisticRegression("many")
    _, urls = await serve_shards(1, (*one.tables(), *many.tables()), rpc=True)
    rpc_port = serve_shards.rpc_servers[0].port
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=6).batch(960)]
    rounds = {}
    for model, d in ((one, 1), (many, 4)):
        async with DelayProxy("127.0.0.1", rpc_port, 0.02) as proxy:
            async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
                config = WorkerConfig("unused:9092", decode_processes=0, mini_batch=48, mini_batch_ramp=0, in_flight=d)
                worker = Worker(config, through(client, [proxy]), control, model)
                metrics = await _train(worker, decode_records(values, model.name, 1 << 20), window_of(values))
            assert metrics.events == 960 and proxy.chunks["up"] > 0
            rounds[d] = proxy.rounds
    # 20 mini-batches: the RPC's hello, the first pull, then one push-pull
    # per mini-batch but the last's push alone.
    assert rounds[1] >= 21, rounds
    assert rounds[4] * 2 < rounds[1], rounds
