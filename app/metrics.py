"""Prometheus metrics of the API, in one `CollectorRegistry` per app (no
global registry, so several apps — tests, the demo — never share counters).

Two kinds:

- the API's own, updated as it works: request counts by route and status,
  predict latency, events predicted, events per scored batch, and the latency
  and errors of every shard call (`instrument` wraps the client's transports);
- the cluster's, read at scrape time (`ApiMetrics.scrape`): features and bytes
  per table and shard, whether each shard answers, and the workers' progress
  from the status board — records consumed, events trained, dead letters by
  reason, windows and their durations, lag per partition, the last window's
  progressive metrics. Workers' totals are exposed as counters by a custom
  collector, from the latest snapshot.

Every worker figure and the lag carry a ``model`` label (a cluster trains
several models; a worker that names none counts as the API's model), and so
do the predict latency and events (the API serves every model).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ps_core.errors import PSError
from ps_core.hashing import U64
from ps_core.net.client import PSReader
from ps_core.net.shard_metrics import by_key, counter_by, exposition, num, port_families, shard_families
from ps_core.net.transports import Pulled, ShardReader
from ps_core.store.storage import F32

from .status import BoardSummary, StatusHook, board_entry, summarize

if TYPE_CHECKING:  # the views time their calls here
    from .api.views import ClusterView

__all__ = [
    "ApiMetrics",
    "ClusterSnapshot",
    "InstrumentedReader",
    "take_snapshot",
    "worker_exposition",
    "worker_families",
]

T = TypeVar("T")
PortStats = dict[str, Any]
"""``{"http": PortGuard.stats(), "rpc": ..., "tls": HandshakeFailures.stats()}`` of the API's port."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the shards said at one scrape."""

    stats: list[dict[str, Any] | None]
    """Each shard's stats, None where the shard did not answer."""
    board: BoardSummary | None
    """The status board of shard 0, None when it did not answer."""
    boards: dict[str, BoardSummary] = field(default_factory=dict)
    """The board per model its workers train (a worker naming none: `ClusterSnapshot.model`'s)."""
    model: str | None = None
    """The API's own model."""
    taken_at: float = field(default_factory=time.time)
    """When (seconds since the epoch)."""


async def take_snapshot(view: ClusterView, model: str | None = None) -> ClusterSnapshot:
    """Every shard's stats and the status board (with `model`, its workers
    only); a shard that does not answer is None, never an error."""
    stats, board = await asyncio.gather(view.stats_each(), view.statuses(), return_exceptions=True)
    for got in (stats, board):
        if isinstance(got, BaseException) and not isinstance(got, PSError):
            raise got
    boards: dict[str, BoardSummary] = {}
    if isinstance(board, list):
        named = {
            e["status"].get("model")
            for e in map(board_entry, board)
            if isinstance(e, dict) and isinstance(e.get("status"), dict) and e["status"].get("kind") == "worker"
        }
        for name in sorted(n for n in named if isinstance(n, str)):
            boards[name] = summarize(board, name)
        if None in named:  # workers from before workers named their model: the API's
            boards.setdefault(model or "", summarize(board, model))
    return ClusterSnapshot(
        stats=[s if isinstance(s, dict) else None for s in stats] if isinstance(stats, list) else [None],
        board=summarize(board, model) if isinstance(board, list) else None,
        boards=boards,
        model=model,
    )


class _ClusterCollector(Collector):
    """Exposes the latest `ClusterSnapshot` (set just before each exposition)
    and the API's own port (`port`, read at each exposition): the port
    families are written once, the API's port and the shards' together."""

    def __init__(self) -> None:
        self.snapshot: ClusterSnapshot | None = None
        self.port: Callable[[], PortStats] | None = None
        self.replica: Callable[[], Mapping[str, int]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.replica is not None:
            yield counter_by(
                "ctrps_replica_read_failures",
                "A serving replica's failed reads of its exports (a version refused, or the store not answering), "
                "by model.",
                "model",
                self.replica(),
            )
        snap = self.snapshot
        own = [] if self.port is None else [("api", "", self.port())]
        if snap is None:
            yield from port_families(own)
            return
        yield from shard_families([(str(i), s) for i, s in enumerate(snap.stats)], own)
        if snap.board is not None:
            # A snapshot built with one board only (no per-model split): the API's model.
            yield from worker_families(snap.boards or {snap.model or "": snap.board}, snap.taken_at)


_QUALITY = ("logloss", "auc", "copc")
_WORKER = ("worker", "model")
_WORKER_FAMILIES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    # (key, kind, name, help, labels): the families of `worker_families`, in
    # their exposition order. A plain figure's key is its key in the status.
    ("records_consumed", "counter", "ctrps_records_consumed", "Kafka records consumed by the worker.", _WORKER),
    ("events_trained", "counter", "ctrps_events_trained", "Events trained by the worker.", _WORKER),
    ("windows", "counter", "ctrps_windows", "Windows trained by the worker.", _WORKER),
    (
        "outages",
        "counter",
        "ctrps_worker_outages",
        "Outages (a shard, the coordinator or the broker unreachable) the worker waited out.",
        _WORKER,
    ),
    (
        "outage_seconds",
        "counter",
        "ctrps_worker_outage_seconds",
        "Seconds the worker spent waiting in outages that ended.",
        _WORKER,
    ),
    (
        "windows_replayed",
        "counter",
        "ctrps_worker_windows_replayed",
        "Windows that failed part-way in an outage and were trained again.",
        _WORKER,
    ),
    (
        "lag_growing_seconds",
        "gauge",
        "ctrps_worker_lag_growing_seconds",
        "Seconds the worker's consumer lag had been growing at its latest report (0: not growing).",
        _WORKER,
    ),
    (
        "lag_warnings",
        "counter",
        "ctrps_worker_lag_warnings",
        "Warnings that the worker's consumer lag kept growing (--lag-warn-seconds).",
        _WORKER,
    ),
    (
        "geo_full_refreshes",
        "counter",
        "ctrps_worker_geo_full_refreshes",
        "Geo rounds after which every row of the worker's copy was read again: the shards' change logs gave "
        "no complete answer (the copy's first round, a restarted shard, or a log that no longer reached back).",
        _WORKER,
    ),
    (
        "geo_rounds",
        "counter",
        "ctrps_worker_geo_rounds",
        "Geo rounds: pushes of the worker's local copy's differences.",
        _WORKER,
    ),
    ("sync_steps", "counter", "ctrps_worker_sync_steps", "Sync steps the worker took part in.", _WORKER),
    (
        "rewinds",
        "counter",
        "ctrps_worker_rewinds",
        "Times a restarted coordinator made the worker resume from its offsets.",
        _WORKER,
    ),
    (
        "info",
        "gauge",
        "ctrps_worker_info",
        "1 per worker, labelled with the update mode of its latest report (async, sync, geo).",
        (*_WORKER, "update_mode"),
    ),
    (
        "commits",
        "counter",
        "ctrps_worker_commits",
        "Offset commits of windows, by outcome (committed; failed: the group rebalanced or the "
        "commit was not acknowledged in time, and the window is trained again; failed_late: one "
        "given up on that failed later in the client).",
        (*_WORKER, "outcome"),
    ),
    ("dead", "counter", "ctrps_dead_letters", "Records dead-lettered, by reason.", (*_WORKER, "reason")),
    (
        "stale",
        "counter",
        "ctrps_worker_stale_offsets",
        "Partitions whose resume offset was not applied as given (another Kafka cluster or group, "
        "beyond the end, before the start), by reason and the action taken (--on-stale-offsets); "
        "reason uncovered: the group committed past the restored state (replayed, refused or lost).",
        (*_WORKER, "reason", "action"),
    ),
    (
        "wire_bytes",
        "counter",
        "ctrps_worker_wire_bytes",
        "Bytes of the worker's pull and push frames, by direction (sent to the shards, received).",
        (*_WORKER, "direction"),
    ),
    (
        "clipped",
        "counter",
        "ctrps_worker_wire_values_clipped",
        "Gradients clipped to float16's range before they were pushed.",
        _WORKER,
    ),
    (
        "key_sets",
        "counter",
        "ctrps_worker_key_set_pushes",
        "Pushes that named the key set of their pull instead of sending keys, by outcome "
        "(named; resent: the shard no longer held the set, the push was sent again with its keys).",
        (*_WORKER, "outcome"),
    ),
    ("window_s", "histogram", "ctrps_window_seconds", "Duration of the worker's windows.", _WORKER),
    (
        "age",
        "gauge",
        "ctrps_worker_report_age_seconds",
        "Seconds since the worker's latest status reached the board.",
        _WORKER,
    ),
    *(
        (
            k,
            "gauge",
            f"ctrps_progressive_{k}",
            f"Progressive {k} of the worker's last window (predicted before training).",
            _WORKER,
        )
        for k in _QUALITY
    ),
    (
        "lag",
        "gauge",
        "ctrps_consumer_lag_records",
        "Records behind per partition: highwater - committed, from the latest report naming it, by model.",
        ("model", "partition"),
    ),
)

_PLAIN = (
    *("records_consumed", "events_trained", "windows", "outages", "outage_seconds", "windows_replayed"),
    *("lag_growing_seconds", "lag_warnings", "rewinds"),
)
"""Worker figures exposed as they are in the status, one sample per worker."""
_MODE_ONLY = ("geo_full_refreshes", "geo_rounds", "sync_steps")
"""A mode's own counts: only from its workers (a status of another mode has none)."""
_FAMILY_KINDS: dict[str, type[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]] = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
}


def worker_families(boards: Mapping[str, BoardSummary], now: float) -> Iterator[Metric]:
    """The families of the workers of `boards` (per model name): their totals
    as counters, the last window's figures, lag per partition; `now` (seconds
    since the epoch, the board's clock) dates each latest report. The API
    writes them from the status board, a worker (``--metrics-port``) from its
    own status: the same families either way."""
    # Any: each kind of family takes its own samples (`add_metric`'s signatures differ).
    families: dict[str, Any] = {
        key: _FAMILY_KINDS[kind](name, doc, labels=list(labels)) for key, kind, name, doc, labels in _WORKER_FAMILIES
    }
    for model, board in boards.items():
        for p, n in board.lag_by_partition.items():
            families["lag"].add_metric([model, str(p)], float(n))
    for model, w in ((m, w) for m, b in boards.items() for w in b.workers):
        _add_worker(families, [w.source, model], w.status, max(0.0, now - w.received_at))
    yield from families.values()


def _add_worker(f: Mapping[str, Any], labels: list[str], s: Mapping[str, Any], age_s: float) -> None:
    """One worker's samples, from its status `s`, into the families `f` (by key)."""
    for key in _PLAIN:
        f[key].add_metric(labels, num(s.get(key)))
    for key in _MODE_ONLY:
        if key in s:
            f[key].add_metric(labels, num(s.get(key)))
    mode = s.get("update_mode")
    if isinstance(mode, str):
        f["info"].add_metric([*labels, mode], 1.0)
    f["commits"].add_metric([*labels, "committed"], num(s.get("commits")))
    f["commits"].add_metric([*labels, "failed"], num(s.get("failed_commits")))
    f["commits"].add_metric([*labels, "failed_late"], num(s.get("late_commit_failures")))
    for reason, count in by_key(s.get("dead_letters_by_reason")):
        f["dead"].add_metric([*labels, reason], count)
    by_stale = s.get("stale_offsets")
    for reason, actions in (by_stale if isinstance(by_stale, dict) else {}).items():
        for action, count in by_key(actions):
            f["stale"].add_metric([*labels, str(reason), action], count)
    wire = s.get("wire")
    if isinstance(wire, dict):
        f["wire_bytes"].add_metric([*labels, "sent"], num(wire.get("bytes_sent")))
        f["wire_bytes"].add_metric([*labels, "received"], num(wire.get("bytes_received")))
        f["clipped"].add_metric(labels, num(wire.get("values_clipped")))
        f["key_sets"].add_metric([*labels, "named"], num(wire.get("key_set_pushes")))
        f["key_sets"].add_metric([*labels, "resent"], num(wire.get("key_set_misses")))
    hist = _histogram(s.get("window_seconds"))
    if hist is not None:
        f["window_s"].add_metric(labels, buckets=hist[0], sum_value=hist[1])
    f["age"].add_metric(labels, age_s)
    last = s.get("last_window")
    for k in _QUALITY:
        v = last.get(k) if isinstance(last, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            f[k].add_metric(labels, num(v))


def worker_exposition(hooks: Sequence[StatusHook]) -> bytes:
    """A worker's own ``/metrics`` (``ctrps worker --metrics-port``): per
    model it trains (`hooks`, one each), the status it reports to the board
    now, as the families the API writes from the board (`worker_families`;
    the report's age is since the board last took one, or since the start),
    and the reports the board took and lost, which the board cannot show."""
    now = time.time()
    boards = {
        hook.model or "": summarize(
            [
                {
                    "source": hook.worker_id,
                    "received_at": hook.sent_at if hook.sent_at is not None else hook.started_at,
                    "status": hook.status(hook.stats.last),
                }
            ],
            hook.model,
        )
        for hook in hooks
    }
    reports = CounterMetricFamily(
        "ctrps_worker_status_reports",
        "Status reports the worker sent to the board after its windows, by outcome (sent: taken; lost: shard 0 "
        "unreachable or the status refused, and that window is missing from the API's figures).",
        labels=["worker", "model", "outcome"],
    )
    for hook in hooks:
        reports.add_metric([hook.worker_id, hook.model or "", "sent"], float(hook.sent))
        reports.add_metric([hook.worker_id, hook.model or "", "lost"], float(hook.lost))
    return exposition([*worker_families(boards, now), reports])


def _histogram(raw: object) -> tuple[list[tuple[str, float]], float] | None:
    """Cumulative Prometheus buckets from a status's ``window_seconds``, or
    None when it is absent or malformed."""
    if not isinstance(raw, dict):
        return None
    bounds, counts, total = raw.get("bounds"), raw.get("counts"), raw.get("sum")
    if (
        not isinstance(bounds, list)
        or not isinstance(counts, list)
        or len(counts) != len(bounds) + 1
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in bounds + counts)
        or not isinstance(total, (int, float))
    ):
        return None
    values = [num(x) for x in bounds + counts + [total]]
    if not all(math.isfinite(x) for x in values):
        return None
    cumulative = np.cumsum(np.asarray(values[len(bounds) : -1], dtype=np.float64)).tolist()
    les = [repr(b) for b in values[: len(bounds)]] + ["+Inf"]
    return list(zip(les, cumulative)), values[-1]


class _RequestTallies(Collector):
    """What the API counts per request, as plain numbers turned into metric
    families at each scrape: requests by route and status, and each model's
    predicted events and predict latency.

    prometheus_client's counters and histograms take a lock per update; the
    three updates of a predict cost about 1.5 µs of its ~70
    (`bench/bench_predict.py`). One event loop updates these, so no lock."""

    def __init__(self) -> None:
        self.counts: Tally[tuple[str, int]] = Tally()
        self.events: Tally[str] = Tally()
        self._latency: dict[str, list[float]] = {}
        """Per model: the requests in each latency bucket (the last above every
        bound), then the seconds summed."""

    def predicted(self, model: str, events: int, seconds: float) -> None:
        self.events[model] += events
        tally = self._latency.get(model)
        if tally is None:
            tally = self._latency[model] = [0.0] * (len(_LATENCY_BUCKETS) + 2)
        tally[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        tally[-1] += seconds

    def latency(self, model: str) -> tuple[float, float, tuple[tuple[float, float], ...]]:
        """`ApiMetrics.predict_latency`."""
        tally = self._latency.get(model)
        if tally is None:
            return 0.0, 0.0, ()
        cumulative = np.cumsum(tally[:-1]).tolist()
        return cumulative[-1], tally[-1], tuple(zip((*_LATENCY_BUCKETS, math.inf), cumulative))

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "ctrps_http_requests", "HTTP requests by route and status.", labels=["route", "status"]
        )
        for (route, status), n in sorted(self.counts.items()):
            requests.add_metric([route, str(status)], n)
        models = sorted(self._latency)
        yield requests
        yield counter_by(
            "ctrps_predict_events",
            "Events predicted (successful requests), by model.",
            "model",
            {m: self.events[m] for m in models},
        )
        seconds = HistogramMetricFamily(
            "ctrps_predict_seconds",
            "Latency of POST /v1/predict, from body read to response, by model.",
            labels=["model"],
        )
        for model in models:
            _, total, buckets = self.latency(model)
            seconds.add_metric([model], [("+Inf" if b == math.inf else repr(b), n) for b, n in buckets], total)
        yield seconds


class ApiMetrics:
    """The API's metrics and their registry."""

    def __init__(self, model: str | None = None) -> None:
        """`model`: the API's model (that of workers which name none)."""
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = _RequestTallies()
        r.register(self._requests)
        self.batch_events = Histogram(
            "ctrps_predict_batch_events",
            "Events per scored batch (concurrent requests are scored together).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "ctrps_shard_rpc_seconds",
            "Latency of shard calls, by shard and operation (retries included).",
            ["shard", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_errors = Counter(
            "ctrps_shard_rpc_errors",
            "Failed shard calls, by shard, operation and error code.",
            ["shard", "op", "error"],
            registry=r,
        )
        self._cluster = _ClusterCollector()
        r.register(self._cluster)

    def watch_port(self, stats: Callable[[], PortStats]) -> None:
        """Expose the API's own port (`ps_core.net.shard_metrics.port_families`,
        role ``api``), read from `stats` at each scrape."""
        self._cluster.port = stats

    def watch_replica(self, read_failures: Callable[[], Mapping[str, int]]) -> None:
        """Expose a serving replica's failed reads of its exports, by model,
        read from `read_failures` at each scrape."""
        self._cluster.replica = read_failures

    def predicted(self, model: str, events: int, seconds: float) -> None:
        """Count a successful predict request of `model`."""
        self._requests.predicted(model, events, seconds)

    def predict_latency(self, model: str) -> tuple[float, float, tuple[tuple[float, float], ...]]:
        """The cumulative predict latency histogram of `model`: requests,
        seconds summed, (upper bound, cumulative requests) per bucket, the
        last +inf (`app.api.history.LatencyTotals`); zeros before its first request."""
        return self._requests.latency(model)

    def count_request(self, route: str, status: int) -> None:
        """Count one answered request."""
        self._requests.counts[route, status] += 1

    def instrument(self, reader: PSReader[ShardReader]) -> PSReader[ShardReader]:
        """A reader over the same transports, timing every pull.

        Closing it closes nothing: `reader`'s owner keeps its connections."""
        return PSReader([InstrumentedReader(t, self) for t in reader.transports])

    async def timed(self, shard: int, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Make and await a shard call, timing it and counting its error by
        code. The call is made here, not by the caller: a task cancelled
        before it starts (a shutdown) then leaves no coroutine never awaited."""
        t0 = time.perf_counter()
        try:
            return await call()
        except PSError as exc:
            self.rpc_errors.labels(str(shard), op, exc.code).inc()
            raise
        finally:
            self.rpc_seconds.labels(str(shard), op).observe(time.perf_counter() - t0)

    def on_batch(self, requests: int, events: int) -> None:
        """A predict batch was scored (`Predictor` callback)."""
        self.batch_events.observe(events)

    async def scrape(self, view: ClusterView) -> bytes:
        """The exposition: the cluster read now, plus the API's own metrics."""
        return self.render(await take_snapshot(view, self.model))

    def render(self, snapshot: ClusterSnapshot) -> bytes:
        """The exposition of `snapshot` plus the API's own metrics."""
        # No await between setting the snapshot and rendering it, so
        # concurrent scrapes never mix snapshots.
        self._cluster.snapshot = snapshot
        return generate_latest(self.registry)


class InstrumentedReader:
    """A `ShardReader` that times each pull of another and counts its errors."""

    def __init__(self, inner: ShardReader, metrics: ApiMetrics) -> None:
        self.inner = inner
        self.shard_id = inner.shard_id
        self._metrics = metrics
        # Bound once: a labelled child per call would cost a dict lookup each.
        self._seconds = metrics.rpc_seconds.labels(str(inner.shard_id), "pull")

    async def _timed(self, call: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await call
        except PSError as exc:
            self._metrics.rpc_errors.labels(str(self.shard_id), "pull", exc.code).inc()
            raise
        finally:
            self._seconds.observe(time.perf_counter() - t0)

    async def pull(self, table: str, keys: U64) -> F32:
        return await self._timed(self.inner.pull(table, keys))

    @property
    def key_sets(self) -> bool:
        return self.inner.key_sets

    async def pull_versioned(self, table: str, keys: U64, presence: bool, remember: int = 0) -> Pulled:
        return await self._timed(self.inner.pull_versioned(table, keys, presence, remember))

    async def close(self) -> None:
        return None  # the inner transport's owner closes it
