"""What a worker says of its progress: each window's report (`WindowReport`,
one log line), the running totals (`WorkerStats`, what the status and
metrics endpoints show), and the consumer lag it watches (`Reports`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from ps_core.model.metrics import Metrics
from ps_core.waits import within

from .decode import Rejected
from .lag_watch import LagWatch, WindowTimes
from .windows import TopicPartitionKey, Window

__all__ = ["WindowReport", "WorkerStats", "Reports"]

log = logging.getLogger("ctrps.worker")


@dataclass(frozen=True)
class WindowReport:
    """What one window did (one log line)."""

    window: int
    partitions: list[int]
    events: int
    records: int
    dlq: int
    metrics: Metrics
    events_per_s: float
    lag: int
    seconds: float
    decode_s: float = 0.0
    decode_wait_s: float = 0.0
    train_s: float = 0.0
    train_cpu_s: float = 0.0
    """The process's CPU time while the window trained (the rest of
    `train_s` waited, mostly on the shards)."""
    lag_by_partition: dict[int, int] = field(default_factory=dict)
    """Records behind per owned partition (highwater − committed), where known."""
    dlq_by_reason: dict[str, int] = field(default_factory=dict)
    """This window's dead letters by reason."""

    def fields(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "window": self.window,
            "partitions": ",".join(map(str, self.partitions)),
            "events": self.events,
            "dlq": self.dlq,
            "logloss": round(m.logloss, 5),
            "auc": round(m.auc, 4),
            "copc": round(m.copc, 3),
            # The window's own processing speed (events / its seconds), named
            # apart from a stream's throughput (the demo's and producer's events_per_s).
            "window_events_per_s": round(self.events_per_s),
            "lag": self.lag,
            "decode_ms": round(self.decode_s * 1000),
            "decode_wait_ms": round(self.decode_wait_s * 1000),
            "train_ms": round(self.train_s * 1000),
        }


@dataclass
class WorkerStats:
    """Running totals."""

    windows: int = 0
    records: int = 0
    events_trained: int = 0
    dead_letters: int = 0
    dead_letters_by_reason: Counter[str] = field(default_factory=Counter)
    commits: int = 0
    rewinds: int = 0
    """Times a restarted coordinator made the worker resume from its offsets."""
    failed_commits: int = 0
    late_commit_failures: int = 0
    """Commits given up on that failed later, in the client (`consumers.late_commits`)."""
    stale_offsets: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Partitions whose resume offset failed a check, by (reason, action)."""
    outages: int = 0
    """Outages waited out (or being waited out): a shard, the coordinator or the broker unreachable."""
    outage_seconds: float = 0.0
    """Seconds spent waiting in outages that ended."""
    sync_steps: int = 0
    """Sync: steps this worker took part in."""
    geo_rounds: int = 0
    """Geo: pushes of the local copy's differences."""
    geo_full_refreshes: int = 0
    """Geo: rounds after which every row of the copy was read again (no
    complete answer from the shards' change logs)."""
    windows_replayed: int = 0
    """Windows that failed part-way in an outage: their partitions resumed from
    the window's first offsets, so that window is trained again."""
    waiting_for: str = ""
    """What the worker waits for now ("" when it is not waiting)."""
    lag_growing_s: float = 0.0
    """Seconds the consumer lag had been growing at its last sample, every
    few seconds (`consumers.lag_watch`; 0: not growing)."""
    lag_warnings: int = 0
    """Warnings that the consumer lag kept growing."""
    last: WindowReport | None = None
    history: list[WindowReport] = field(default_factory=list)


class Reports:
    """Counts each window into its stats and logs its line, and watches the
    consumer lag (`consumers.lag_watch`) while the worker runs."""

    def __init__(self, stats: WorkerStats, lag_watch: LagWatch) -> None:
        self.stats = stats
        self.lag_watch = lag_watch

    @staticmethod
    def lag(consumer: Any, committed: dict[TopicPartitionKey, int]) -> dict[int, int]:
        """Records behind per owned partition: highwater − next offset to apply."""
        lag: dict[int, int] = {}
        for tp in consumer.assignment():
            hw = consumer.highwater(tp)
            done = committed.get((tp.topic, tp.partition))
            if hw is not None and done is not None:
                lag[tp.partition] = max(0, hw - done)
        return lag

    def report(
        self,
        window: Window,
        metrics: Metrics,
        rejected: list[Rejected],
        times: WindowTimes,
        decode_s: float,
        lag: dict[int, int],
        beside: tuple[str, WorkerStats] | None = None,
    ) -> WindowReport:
        """The window's report, counted in the worker's stats (or, for a model
        trained beside, `beside` = its name and stats, which mirror the
        worker's counts)."""
        seconds = times.seconds
        report = WindowReport(
            window=window.seq,
            partitions=sorted({p for _, p in window.next_offsets}),
            events=metrics.events,
            records=window.size,
            dlq=len(rejected),
            metrics=metrics,
            events_per_s=metrics.events / seconds if seconds > 0 else 0.0,
            lag=sum(lag.values()),
            seconds=seconds,
            decode_s=decode_s,
            decode_wait_s=times.decode_wait_s,
            train_s=times.train_s,
            train_cpu_s=times.train_cpu_s,
            lag_by_partition=lag,
            dlq_by_reason=dict(Counter(r.reason for r in rejected)),
        )
        s = self.stats if beside is None else beside[1]
        s.windows += 1
        s.records += window.size
        s.dead_letters += report.dlq
        s.dead_letters_by_reason.update(report.dlq_by_reason)
        s.last = report
        s.history.append(report)
        del s.history[:-1000]
        if beside is not None:
            w = self.stats
            s.commits, s.failed_commits, s.rewinds = w.commits, w.failed_commits, w.rewinds
            s.late_commit_failures = w.late_commit_failures
            s.outages, s.outage_seconds, s.windows_replayed = w.outages, w.outage_seconds, w.windows_replayed
            s.stale_offsets = Counter(w.stale_offsets)
            log.info("window", extra={"fields": {**report.fields(), "model": beside[0]}})
        else:
            log.info("window", extra={"fields": report.fields()})
            self.lag_watch.window(times)
        return report

    async def watch_lag(self, consumer: Any, committed: dict[TopicPartitionKey, int]) -> None:
        """While the worker runs: every few seconds, the lag of its partitions
        (the broker's end offsets less the commits) to the lag watch, its
        line logged and its figures in the stats. Outages reset it."""
        watch, s = self.lag_watch, self.stats
        if watch.warn_after_s <= 0:
            return
        while True:
            await asyncio.sleep(watch.every_s)
            known = [tp for tp in consumer.assignment() if (tp.topic, tp.partition) in committed]
            if s.waiting_for:
                watch.reset()
            elif known:
                try:
                    ends = await within(consumer.end_offsets(known), 10)
                except (KafkaError, OSError, TimeoutError):
                    continue  # the broker's own watch says when it is away
                # Tansu 0.6 answers end_offsets with the last batch's base
                # offset + 1 (short by up to a batch); the consumer's high
                # watermark is right but only as fresh as its last fetch.
                ends = {tp: max(ends[tp], consumer.highwater(tp) or 0) for tp in known}
                lag = sum(max(0, ends[tp] - committed[(tp.topic, tp.partition)]) for tp in known)
                parts = frozenset(tp.partition for tp in known)
                notice = watch.observe(time.monotonic(), lag, s.records, s.events_trained, parts)
                if notice is not None:
                    log.log(notice.level, notice.message, extra={"fields": notice.fields})
            s.lag_growing_s, s.lag_warnings = watch.growing_s, watch.warnings
