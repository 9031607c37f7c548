"""A worker's reports (`consumers.reports`): each window counted in its
stats, a model trained beside mirroring the worker's counts, and the lag."""

from __future__ import annotations

from collections import Counter

import numpy as np
from aiokafka import TopicPartition
from consumer_side import Consumer

from consumers.decode import Rejected
from consumers.lag_watch import LagWatch, WindowTimes
from consumers.reports import Reports, WorkerStats
from consumers.windows import Window
from ps_core.model.metrics import evaluate


def _window(seq: int, n: int) -> Window:
    return Window(
        seq=seq,
        values=[b"{}"] * n,
        partitions=[("clicks", 0), ("clicks", 2)],
        record_partition=np.arange(n, dtype=np.int32) % 2,
        offsets=np.arange(n, dtype=np.int64),
        next_offsets={("clicks", 0): n, ("clicks", 2): n},
        first_ts_ms=0,
        last_ts_ms=0,
    )


def test_each_window_is_counted_and_a_model_beside_mirrors_the_workers_counts() -> None:
    stats = WorkerStats(commits=4, outages=1, stale_offsets=Counter({("cluster", "earliest"): 2}))
    reports = Reports(stats, LagWatch(0))
    metrics = evaluate(np.array([0.9, 0.2, 0.6]), np.array([1, 0, 1], dtype=np.float32))
    rejected = [Rejected(3, "invalid_json", "x"), Rejected(4, "oversized", "y"), Rejected(5, "invalid_json", "z")]
    times = WindowTimes(2.0, decode_wait_s=0.5, train_s=1.0, train_cpu_s=0.25)
    report = reports.report(_window(7, 6), metrics, rejected, times, 0.75, {0: 5, 2: 1})
    assert (report.window, report.partitions, report.events, report.records, report.dlq) == (7, [0, 2], 3, 6, 3)
    assert (
        report.events_per_s == 1.5 and report.lag == 6 and report.dlq_by_reason == {"invalid_json": 2, "oversized": 1}
    )
    assert report.fields()["window_events_per_s"] == 2 and report.fields()["decode_ms"] == 750
    assert (stats.windows, stats.records, stats.dead_letters, stats.last) == (1, 6, 3, report)
    assert stats.dead_letters_by_reason == {"invalid_json": 2, "oversized": 1}
    beside = WorkerStats()
    reports.report(_window(7, 6), metrics, [], times, 0.75, {}, beside=("other", beside))
    assert (beside.windows, beside.records, beside.dead_letters) == (1, 6, 0)
    assert (beside.commits, beside.outages, beside.stale_offsets) == (4, 1, stats.stale_offsets)
    assert stats.windows == 1  # the worker's own counts are its own


def test_the_lag_is_the_high_watermark_less_the_commit_where_both_are_known() -> None:
    tps = [TopicPartition("clicks", p) for p in range(3)]
    consumer = Consumer(set(tps), highwater={tps[0]: 100, tps[1]: 50})
    committed = {("clicks", 0): 60, ("clicks", 2): 10}
    assert Reports.lag(consumer, committed) == {0: 40}
