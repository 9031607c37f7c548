"""The worker against the real broker: training, dead letters, commits."""

from __future__ import annotations

import collections
import gc
import itertools
from typing import Any

import numpy as np
import orjson
import pytest
import streams
from waiting import until

from consumers.collector import YOUNG_THRESHOLD
from consumers.decode import decode_records
from consumers.dlq import read_headers
from consumers.reports import WindowReport
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow


async def _run_until(worker: Worker, done: Any, timeout_s: float = 60.0) -> None:
    """Run the worker until done() holds (checked between windows) or time runs out."""
    async with streams.running(worker, 30) as task:
        await until(done, timeout_s, what=f"the worker to be done ({worker.stats})", task=task, poll_s=0.05)


def _good(i: int) -> bytes:
    return orjson.dumps(
        {
            "id": f"g{i}",
            "ts": 1_764_681_600 + i,
            "label": i % 3 == 0 and 1 or 0,
            "features": {"site": f"s{i % 7}", "ad": f"a{i % 11}", "price": 1.5},
        }
    )


async def test_bad_messages_are_dead_lettered_and_good_ones_trained_once(kafka_bootstrap: str) -> None:
    topic, group = await streams.new_topic(kafka_bootstrap, 2, hex_digits=10)
    dlq = topic + ".dlq"
    bad = {
        b"{not json": "invalid_json",
        b'{"label": 1, "features": {"a": "x"}, "p": NaN}': "invalid_json",
        b"": "empty",
        b'{"features": {"a": "x"}}': "missing_label",
        b'{"label": "yes", "features": {"a": "x"}}': "bad_label",
        b'{"label": 1, "features": {"a": {"deep": 1}}}': "bad_value",
        b'{"label": 1, "features": ["a"]}': "bad_features",
        b'{"label": 1, "features": {"a": "' + b"x" * 3000 + b'"}}': "oversized",
        b'[{"label": 1, "keys": [1]}, {"label": 1, "keys": [-5]}]': "bad_keys",
    }
    values: list[bytes] = []
    good = 0
    for raw in bad:
        values += [_good(good), _good(good + 1), raw]
        good += 2
    values += [orjson.dumps([orjson.loads(_good(good)), orjson.loads(_good(good + 1))])]  # one array message
    good += 2
    await streams.produce(kafka_bootstrap, topic, values, 2)

    model = LogisticRegression("m")
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    config = streams.worker_config(
        kafka_bootstrap, topic, group, 7, window_seconds=0.3, mini_batch=4, max_message_bytes=2000
    )
    reports: list[Any] = []
    young_thresholds: set[int] = set()
    before = gc.get_threshold()

    async def on_window(report: Any) -> None:
        reports.append(report)
        young_thresholds.add(gc.get_threshold()[0])
        if len(reports) == 1:
            raise RuntimeError("a failing window hook is only logged")

    worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), model, on_window=on_window)
    await _run_until(worker, lambda: worker.stats.records >= len(values))

    # Every bad message is in the DLQ with its reason and source offset.
    letters = await streams.consume_all(kafka_bootstrap, dlq, len(bad), timeout_s=20)
    got = {}
    for rec in letters:
        h = read_headers(rec.headers)
        assert h["ctrps-source-topic"] == topic
        src = (int(h["ctrps-source-partition"]), int(h["ctrps-source-offset"]))
        got[rec.value] = (h["ctrps-reason"], src)
    assert {v: r for v, (r, _) in got.items()} == bad
    for raw, (_, (p, off)) in got.items():
        i = values.index(raw)
        assert (p, off) == (i % 2, i // 2)  # where it was produced

    # Every good event trained exactly once: the bias feature was shown once per event.
    assert streams.bias_shows(shards) == good
    assert worker.stats.events_trained == good
    assert worker.stats.dead_letters == len(bad)
    assert worker.stats.last is not None and worker.stats.last.metrics.events > 0
    # The window hook saw every window, with its dead letters by reason.
    assert len(reports) == worker.stats.windows
    # The running worker collected young objects less often; stopped, it restored that.
    assert young_thresholds == {max(YOUNG_THRESHOLD, before[0])}
    assert gc.get_threshold() == before
    by_reason: dict[str, int] = {}
    for r in reports:
        for reason, n in r.dlq_by_reason.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    assert by_reason == dict(worker.stats.dead_letters_by_reason) == dict(collections.Counter(bad.values()))
    # Offsets are committed to the end of each partition.
    committed = await streams.committed(kafka_bootstrap, group, topic, 2)
    assert committed == {0: (len(values) + 1) // 2, 1: len(values) // 2}


async def test_worker_learns_the_synthetic_stream(kafka_bootstrap: str) -> None:
    """50k synthetic events through one worker; then later, held-out events
    score close to the ground-truth model."""
    from consumers.producer import produce
    from ps_core.model.metrics import auc
    from ps_core.model.models import sigmoid
    from ps_core.synthetic import SyntheticStream

    topic, group = await streams.new_topic(kafka_bootstrap, 4, hex_digits=10)
    stream = SyntheticStream(seed=3)
    n = 50_000
    report = await produce(kafka_bootstrap, topic, itertools.chain.from_iterable(stream.iter_batches(n, 10_000)))
    assert report.sent == n
    held_out = stream.batch(10_000)  # later events, never trained on

    model = LogisticRegression("ctr")
    local = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(local), ControlClient.local(local)
    config = WorkerConfig(
        kafka_bootstrap, topic=topic, group=group, window_seconds=2.0, window_events=5000, decode_processes=1
    )
    worker = Worker(config, client, control, model)
    await _run_until(worker, lambda: worker.stats.events_trained >= n, timeout_s=120)
    assert worker.stats.events_trained == n and worker.stats.dead_letters == 0
    assert worker.stats.windows >= 10

    decoded = decode_records([orjson.dumps(e) for e in held_out], "ctr", 1 << 20)
    plan = model.plan(decoded.batch)
    weights = {t: await client.pull(t, plan.keys) for t in model.table_names}
    p = sigmoid(model.logits(decoded.batch, plan, weights))
    y = np.array([e["label"] for e in held_out])
    truth = auc([e["p_true"] for e in held_out], y)
    got = auc(p, y)
    assert got >= 0.75 and got >= truth - 0.03, (got, truth)
    # Progressive validation improved as the stream went on: the first
    # window (its first predictions from an empty model) against the windows
    # of the stream's second half, weighted by their events. Not the last
    # window alone: its size is whatever the stream's end left, and a few
    # hundred events make a noisy AUC.
    hist = worker.stats.history
    late_auc = _second_half_auc(hist, n)
    assert late_auc > hist[0].metrics.auc, ([(w.events, round(w.metrics.auc, 4)) for w in hist], late_auc)


async def test_an_fm_worker_trains_both_tables(kafka_bootstrap: str) -> None:
    from consumers.producer import produce
    from ps_core.model.models import FactorizationMachine
    from ps_core.synthetic import SyntheticStream

    topic, group = await streams.new_topic(kafka_bootstrap, 2, hex_digits=10)
    n = 6000
    await produce(kafka_bootstrap, topic, SyntheticStream(seed=5, vocab=200).batch(n))
    model = FactorizationMachine("fm", k=4)
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    worker = Worker(
        WorkerConfig(
            kafka_bootstrap, topic=topic, group=group, window_seconds=1.0, window_events=1500, decode_processes=0
        ),
        PSClient.local(shards),
        ControlClient.local(shards),
        model,
    )
    await _run_until(worker, lambda: worker.stats.events_trained >= n)
    for table in ("fm_w", "fm_v"):
        assert sum(len(s.tables[table]) for s in shards) > 1000
        assert sum(s.tables[table].pushes for s in shards) > 0
    hist = worker.stats.history
    late_auc = _second_half_auc(hist, n)  # the last window alone may be a few events
    assert late_auc > 0.65 and late_auc > hist[0].metrics.auc, ([(w.events, w.metrics.auc) for w in hist], late_auc)


def _second_half_auc(history: list[WindowReport], n: int) -> float:
    """The progressive AUC of the windows of the second half of `n` events, weighted by their events."""
    seen = np.cumsum([w.events for w in history])
    late = [w for w, upto in zip(history, seen, strict=True) if upto > n / 2]
    return sum(w.metrics.auc * w.events for w in late) / sum(w.events for w in late)


async def test_leased_windows_report_offsets_and_a_restore_seeks_to_them(kafka_bootstrap: str) -> None:
    from ps_core.checkpoint.coordinator import Coordinator

    topic, group = await streams.new_topic(kafka_bootstrap, 2, hex_digits=10)
    values = [_good(i) for i in range(400)]
    await streams.produce(kafka_bootstrap, topic, values, 2)
    config = streams.worker_config(kafka_bootstrap, topic, group, 50, window_seconds=0.3)

    # Every window is leased; released leases carry the committed offsets.
    coord = Coordinator(lease_ttl_s=30)
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    worker = Worker(config, PSClient.local(shards), ControlClient.local(shards, coord), LogisticRegression("m"))
    await _run_until(worker, lambda: worker.stats.records >= len(values))
    # One lease per window, and one at start (which finds the coordinator's epoch).
    assert worker.leased and coord.leases_granted == worker.stats.windows + 1 and coord.active_leases == 0
    assert coord.offsets() == {topic: {0: 200, 1: 200}}
    assert await streams.committed(kafka_bootstrap, group, topic, 2) == {0: 200, 1: 200}

    # Restored shards (empty here) whose cut holds offsets 150 and 120: a
    # worker of the same group resumes there, not at the group's commits,
    # and trains exactly what the cut lacks.
    restored = Coordinator(offsets={topic: {0: 150, 1: 120}})
    fresh = [Shard(ShardSpec(i, 2)) for i in range(2)]
    again = Worker(config, PSClient.local(fresh), ControlClient.local(fresh, restored), LogisticRegression("m"))
    await _run_until(again, lambda: again.stats.records >= 130)
    assert streams.bias_shows(fresh) == again.stats.events_trained == 130
    assert restored.offsets() == {topic: {0: 200, 1: 200}}

    # Without a coordinator the worker trains unleased.
    plain = Worker(
        config, PSClient.local(one := [Shard(ShardSpec(0, 1))]), ControlClient.local(one), LogisticRegression("m")
    )
    await _run_until(plain, lambda: plain._consumer is not None and plain._consumer.assignment() != set(), 30)
    assert not plain.leased


async def test_a_worker_that_outlives_its_coordinator_rewinds_to_the_new_ones_offsets(kafka_bootstrap: str) -> None:
    """Shards restored under a new coordinator (a new epoch) hold an older cut
    than the running worker's commits: the worker drops what it holds and
    resumes from the new coordinator's offsets, training each later event once."""
    from ps_core.checkpoint.coordinator import Coordinator

    topic, group = await streams.new_topic(kafka_bootstrap, 2, hex_digits=10)
    await streams.produce(kafka_bootstrap, topic, [_good(i) for i in range(400)], 2)
    config = streams.worker_config(kafka_bootstrap, topic, group, 50, window_seconds=0.3)
    local = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(local), ControlClient.local(local, Coordinator())
    worker = Worker(config, client, control, LogisticRegression("m"))
    async with streams.running(worker, 30) as task:
        await until(lambda: worker.stats.records >= 400, 60, what="400 records", task=task)
        # "Restored" shards: a cut at offsets 50 and 50 that held nothing.
        fresh = [Shard(ShardSpec(i, 2)) for i in range(2)]
        async with worker._lock:  # no window is applying while the shards change
            client.transports[:] = PSClient.local(fresh).transports
            control.shards[:] = ControlClient.local(fresh, Coordinator(offsets={topic: {0: 50, 1: 50}})).shards
        # The stream goes on; the worker's next lease finds the new coordinator.
        await streams.produce(kafka_bootstrap, topic, [_good(i) for i in range(400, 500)], 2)
        await until(
            lambda: worker.stats.rewinds == 1 and streams.bias_shows(fresh) >= 400,
            60,
            what="the rewind and 400 events trained again",
            task=task,
        )
    assert streams.bias_shows(fresh) == 400 and worker.stats.rewinds == 1
