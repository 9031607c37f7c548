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
from collections.abc import Awaitable, Callable, Iterator
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
from ps_core.net.transports import Pulled, ShardReader
from ps_core.store.table import F32

from .port_metrics import PortCollector, PortStats, port_families
from .status import BoardSummary, summarize

if TYPE_CHECKING:  # the views time their calls here
    from .views import ClusterView

__all__ = ["ApiMetrics", "ClusterSnapshot", "InstrumentedReader", "take_snapshot"]

T = TypeVar("T")
_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)

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
            for e in board
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
    """Exposes the latest `ClusterSnapshot` (set just before each exposition)."""

    def __init__(self) -> None:
        self.snapshot: ClusterSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        yield from self._shards(snap)
        if snap.board is not None:
            # A snapshot built with one board only (no per-model split): the API's model.
            yield from self._workers(snap.boards or {snap.model or "": snap.board}, snap.taken_at)

    @staticmethod
    def _shards(snap: ClusterSnapshot) -> Iterator[Metric]:
        def per_table(kind: type[_Family], name: str, doc: str, *more: str) -> _Family:
            # Every table figure is per shard and table, some by one label more.
            return kind(name, doc, labels=["shard", "table", *more])

        up = GaugeMetricFamily("ctrps_shard_up", "Whether the shard answered at this scrape.", labels=["shard"])
        features = per_table(GaugeMetricFamily, "ctrps_table_features", "Features (rows) per table and shard.")
        size = per_table(GaugeMetricFamily, "ctrps_table_bytes", "Bytes allocated per table and shard.")
        evicted = per_table(
            CounterMetricFamily,
            "ctrps_table_evicted_rows",
            "Rows removed by eviction, by rule (ttl, score, max_rows).",
            "rule",
        )
        freed = per_table(
            CounterMetricFamily,
            "ctrps_table_evicted_bytes",
            "Bytes of the rows removed by eviction (reused by new rows).",
        )
        pause = per_table(
            GaugeMetricFamily, "ctrps_table_eviction_pause_ms", "How long the last eviction pass held the table."
        )
        admission = per_table(
            CounterMetricFamily,
            "ctrps_table_admission",
            "Keys without a row a push met: admitted (given one) or dropped (their update with them).",
            "outcome",
        )
        staleness = per_table(
            HistogramMetricFamily,
            "ctrps_table_push_staleness",
            "How stale the async pushes a table applied were: pushes applied between the pull a gradient "
            "was computed from and its push.",
        )
        down_weighted = per_table(
            CounterMetricFamily,
            "ctrps_table_pushes_down_weighted",
            "Async pushes scaled down for being staler than the model's max_staleness.",
        )
        log_keys = per_table(
            GaugeMetricFamily,
            "ctrps_table_change_log_keys",
            "Keys a geo table's change log holds (what geo workers ask at each round's end).",
        )
        log_incomplete = per_table(
            CounterMetricFamily,
            "ctrps_table_change_log_incomplete",
            "Geo workers' questions a table's change log could not answer whole (it no longer reached back, "
            "or the worker asked another incarnation): the worker read every row again.",
        )
        for i, stats in enumerate(snap.stats):
            up.add_metric([str(i)], 0.0 if stats is None else 1.0)
            for name, t in (stats or {}).get("tables", {}).items():
                features.add_metric([str(i), name], float(t["features"]))
                size.add_metric([str(i), name], float(t["bytes"]))
                changes = t.get("change_log")
                if isinstance(changes, dict):
                    log_keys.add_metric([str(i), name], _num(changes.get("keys")))
                    log_incomplete.add_metric([str(i), name], _num(changes.get("incomplete")))
                stale = t.get("staleness")
                if isinstance(stale, dict) and isinstance(stale.get("buckets"), dict):
                    cumulative, buckets = 0.0, []
                    for bound, n in stale["buckets"].items():
                        cumulative += _num(n)
                        buckets.append((bound, cumulative))
                    staleness.add_metric([str(i), name], buckets, _num(stale.get("sum")))
                    down_weighted.add_metric([str(i), name], _num(stale.get("down_weighted")))
                life = t.get("lifecycle")
                if not isinstance(life, dict):
                    continue
                for rule, n in life.get("evicted", {}).items():
                    evicted.add_metric([str(i), name, str(rule)], _num(n))
                freed.add_metric([str(i), name], _num(life.get("bytes_freed")))
                if life.get("last_eviction_ms") is not None:
                    pause.add_metric([str(i), name], _num(life["last_eviction_ms"]))
                for outcome in ("admitted", "dropped"):
                    if outcome in life.get("admission", {}):
                        admission.add_metric([str(i), name, outcome], _num(life["admission"][outcome]))
        refused = CounterMetricFamily(
            "ctrps_shard_auth_refused",
            "Requests and RPC connections a shard refused for their credentials, by reason (missing, wrong, scope).",
            labels=["shard", "reason"],
        )
        for i, stats in enumerate(snap.stats):
            auth = (stats or {}).get("auth")
            for reason, n in _by_key(auth.get("refused") if isinstance(auth, dict) else None):
                refused.add_metric([str(i), reason], n)
        held = GaugeMetricFamily(
            "ctrps_shard_key_sets", "Key sets a shard keeps from pulls for the pushes that name them.", labels=["shard"]
        )
        sets_gone = CounterMetricFamily(
            "ctrps_shard_key_sets_expired",
            "Pushes that named a key set the shard no longer held (the worker sent them again with keys).",
            labels=["shard"],
        )
        reply_clipped = CounterMetricFamily(
            "ctrps_shard_reply_values_clipped",
            "Weights clipped to float16's range in float16 replies.",
            labels=["shard"],
        )
        for i, stats in enumerate(snap.stats):
            wire = (stats or {}).get("wire")
            sets = wire.get("key_sets") if isinstance(wire, dict) else None
            if isinstance(sets, dict) and isinstance(wire, dict):
                held.add_metric([str(i)], _num(sets.get("sets")))
                sets_gone.add_metric([str(i)], _num(sets.get("expired")))
                reply_clipped.add_metric([str(i)], _num(wire.get("reply_values_clipped")))
        yield from (up, features, size, evicted, freed, pause, admission, staleness, down_weighted, refused)
        yield from (held, sets_gone, reply_clipped, log_keys, log_incomplete)
        yield from port_families(("shard", str(i), (stats or {}).get("ports")) for i, stats in enumerate(snap.stats))
        yield from _ClusterCollector._exports(snap.stats[0] if snap.stats else None)

    @staticmethod
    def _exports(stats0: dict[str, Any] | None) -> Iterator[Metric]:
        """Shard 0's exporter and coordinator figures (absent when it hosts none)."""
        sections = {k: v for k, v in (stats0 or {}).items() if isinstance(v, dict)}
        for section, kind, name, doc, key in _SHARD0_VALUES:
            if section in sections:
                raw = sections[section].get(key)
                # A flag reads as 0 or 1, a list as its length, anything else as a number.
                value = float(raw) if isinstance(raw, bool) else float(len(raw)) if isinstance(raw, list) else _num(raw)
                yield kind(name, doc, value=value)
        for section, name, doc, label, key in _SHARD0_COUNTS_BY:
            if section in sections:
                yield _counter_by(name, doc, label, sections[section].get(key))

    @staticmethod
    def _workers(boards: dict[str, BoardSummary], now: float) -> Iterator[Metric]:
        def counter(name: str, doc: str, *more: str) -> CounterMetricFamily:
            # Every worker figure is per worker and model, some by more labels.
            return CounterMetricFamily(name, doc, labels=["worker", "model", *more])

        records = counter("ctrps_records_consumed", "Kafka records consumed by the worker.")
        trained = counter("ctrps_events_trained", "Events trained by the worker.")
        windows = counter("ctrps_windows", "Windows trained by the worker.")
        outages = counter(
            "ctrps_worker_outages",
            "Outages (a shard, the coordinator or the broker unreachable) the worker waited out.",
        )
        outage_s = counter("ctrps_worker_outage_seconds", "Seconds the worker spent waiting in outages that ended.")
        replayed = counter(
            "ctrps_worker_windows_replayed", "Windows that failed part-way in an outage and were trained again."
        )
        lag_growing = GaugeMetricFamily(
            "ctrps_worker_lag_growing_seconds",
            "Seconds the worker's consumer lag had been growing at its latest report (0: not growing).",
            labels=["worker", "model"],
        )
        lag_warnings = counter(
            "ctrps_worker_lag_warnings", "Warnings that the worker's consumer lag kept growing (--lag-warn-seconds)."
        )
        geo_full = counter(
            "ctrps_worker_geo_full_refreshes",
            "Geo rounds after which every row of the worker's copy was read again: the shards' change logs gave "
            "no complete answer (the copy's first round, a restarted shard, or a log that no longer reached back).",
        )
        commits = counter(
            "ctrps_worker_commits",
            "Offset commits of windows, by outcome (committed; failed: the group rebalanced or the "
            "commit was not acknowledged in time, and the window is trained again).",
            "outcome",
        )
        dead = counter("ctrps_dead_letters", "Records dead-lettered, by reason.", "reason")
        stale = counter(
            "ctrps_worker_stale_offsets",
            "Partitions whose resume offset was not applied as given (another Kafka cluster or group, "
            "beyond the end, before the start), by reason and the action taken (--on-stale-offsets); "
            "reason uncovered: the group committed past the restored state (replayed, refused or lost).",
            "reason",
            "action",
        )
        wire_bytes = counter(
            "ctrps_worker_wire_bytes",
            "Bytes of the worker's pull and push frames, by direction (sent to the shards, received).",
            "direction",
        )
        clipped = counter(
            "ctrps_worker_wire_values_clipped", "Gradients clipped to float16's range before they were pushed."
        )
        key_sets = counter(
            "ctrps_worker_key_set_pushes",
            "Pushes that named the key set of their pull instead of sending keys, by outcome "
            "(named; resent: the shard no longer held the set, the push was sent again with its keys).",
            "outcome",
        )
        window_s = HistogramMetricFamily(
            "ctrps_window_seconds", "Duration of the worker's windows.", labels=["worker", "model"]
        )
        age = GaugeMetricFamily(
            "ctrps_worker_report_age_seconds",
            "Seconds since the worker's latest status reached the board.",
            labels=["worker", "model"],
        )
        quality = {
            k: GaugeMetricFamily(
                f"ctrps_progressive_{k}",
                f"Progressive {k} of the worker's last window (predicted before training).",
                labels=["worker", "model"],
            )
            for k in ("logloss", "auc", "copc")
        }
        lag = GaugeMetricFamily(
            "ctrps_consumer_lag_records",
            "Records behind per partition: highwater - committed, from the latest report naming it, by model.",
            labels=["model", "partition"],
        )
        for model, board in boards.items():
            for p, n in board.lag_by_partition.items():
                lag.add_metric([model, str(p)], float(n))
        for model, w in ((m, w) for m, b in boards.items() for w in b.workers):
            s, labels = w.status, [w.source, model]
            records.add_metric(labels, _num(s.get("records_consumed")))
            trained.add_metric(labels, _num(s.get("events_trained")))
            windows.add_metric(labels, _num(s.get("windows")))
            outages.add_metric(labels, _num(s.get("outages")))
            outage_s.add_metric(labels, _num(s.get("outage_seconds")))
            replayed.add_metric(labels, _num(s.get("windows_replayed")))
            lag_growing.add_metric(labels, _num(s.get("lag_growing_seconds")))
            lag_warnings.add_metric(labels, _num(s.get("lag_warnings")))
            if "geo_full_refreshes" in s:
                geo_full.add_metric(labels, _num(s.get("geo_full_refreshes")))
            commits.add_metric([*labels, "committed"], _num(s.get("commits")))
            commits.add_metric([*labels, "failed"], _num(s.get("failed_commits")))
            for reason, count in _by_key(s.get("dead_letters_by_reason")):
                dead.add_metric([*labels, reason], count)
            by_stale = s.get("stale_offsets")
            for reason, actions in (by_stale if isinstance(by_stale, dict) else {}).items():
                for action, count in _by_key(actions):
                    stale.add_metric([*labels, str(reason), action], count)
            wire = s.get("wire")
            if isinstance(wire, dict):
                wire_bytes.add_metric([*labels, "sent"], _num(wire.get("bytes_sent")))
                wire_bytes.add_metric([*labels, "received"], _num(wire.get("bytes_received")))
                clipped.add_metric(labels, _num(wire.get("values_clipped")))
                key_sets.add_metric([*labels, "named"], _num(wire.get("key_set_pushes")))
                key_sets.add_metric([*labels, "resent"], _num(wire.get("key_set_misses")))
            hist = _histogram(s.get("window_seconds"))
            if hist is not None:
                window_s.add_metric(labels, buckets=hist[0], sum_value=hist[1])
            age.add_metric(labels, max(0.0, now - w.received_at))
            last = s.get("last_window")
            for k, family in quality.items():
                v = last.get(k) if isinstance(last, dict) else None
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    family.add_metric(labels, _num(v))
        yield from (
            records,
            trained,
            windows,
            outages,
            outage_s,
            replayed,
            lag_growing,
            lag_warnings,
            geo_full,
            commits,
            dead,
            stale,
            wire_bytes,
            clipped,
            key_sets,
            window_s,
            age,
            *quality.values(),
            lag,
        )


# Shard 0's single figures: (status section, family, name, help, field).
_SHARD0_VALUES: tuple[tuple[str, type[CounterMetricFamily | GaugeMetricFamily], str, str, str], ...] = (
    ("exports", CounterMetricFamily, "ctrps_exports", "Export versions written by shard 0's exporter.", "exports"),
    (
        "cluster",
        CounterMetricFamily,
        "ctrps_cluster_restores",
        "Times every shard was made to load one export version together.",
        "cluster_restores",
    ),
    (
        "cluster",
        CounterMetricFamily,
        "ctrps_versions_refused",
        "Export versions a shard refused to load (a damaged file).",
        "versions_refused",
    ),
    (
        "cluster",
        GaugeMetricFamily,
        "ctrps_cluster_ready",
        "Whether every shard is joined at one version (leases granted).",
        "ready",
    ),
    ("cluster", GaugeMetricFamily, "ctrps_cluster_version", "The export version the shards were joined at.", "version"),
    ("sync", CounterMetricFamily, "ctrps_sync_steps", "Sync steps the coordinator's barrier closed.", "steps_closed"),
    (
        "sync",
        CounterMetricFamily,
        "ctrps_sync_quorum_shrinks",
        "Sync steps closed without a member that did not arrive within the deadline.",
        "shrinks",
    ),
    ("sync", GaugeMetricFamily, "ctrps_sync_members", "Workers inside a window, taking part in sync steps.", "members"),
)
# Shard 0's counts by a label: (status section, name, help, label, field).
_SHARD0_COUNTS_BY = (
    (
        "exports",
        "ctrps_export_failures",
        "Failed export cuts (aborted on every shard) and writes, by reason.",
        "reason",
        "failures",
    ),
    ("sync", "ctrps_sync_members_dropped", "Times a worker was dropped from a sync step.", "worker", "dropped"),
)


def _num(v: object) -> float:
    """A status field as a sample value (0 when it is not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    try:
        return float(v)
    except OverflowError:  # an integer beyond a float's range
        return math.copysign(math.inf, v)


def _by_key(raw: object) -> list[tuple[str, float]]:
    """A status's counts by key (reason, worker, ...) as (label, sample value);
    none when it is not a mapping."""
    return [(str(k), _num(n)) for k, n in raw.items()] if isinstance(raw, dict) else []


def _counter_by(name: str, doc: str, label: str, raw: object) -> CounterMetricFamily:
    """A counter of one `label`, a sample per key of the counts `raw` (`_by_key`)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in _by_key(raw):
        family.add_metric([key], n)
    return family


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
    values = [_num(x) for x in bounds + counts + [total]]
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
        yield _counter_by(
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
        self._port: PortCollector | None = None

    def watch_port(self, stats: Callable[[], PortStats]) -> None:
        """Expose the API's own port (`app.port_metrics`), read from `stats` at each scrape."""
        if self._port is not None:
            self.registry.unregister(self._port)
        self._port = PortCollector(stats)
        self.registry.register(self._port)

    def predicted(self, model: str, events: int, seconds: float) -> None:
        """Count a successful predict request of `model`."""
        self._requests.predicted(model, events, seconds)

    def predict_latency(self, model: str) -> tuple[float, float, tuple[tuple[float, float], ...]]:
        """The cumulative predict latency histogram of `model`: requests,
        seconds summed, (upper bound, cumulative requests) per bucket, the
        last +inf (`app.history.LatencyTotals`); zeros before its first request."""
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
