"""The dashboard's history: a bounded series of samples of the cluster, kept
in the API process.

Every `History.interval_s` a background task reads the shards' stats and the
status board of shard 0 (the same two reads as ``GET /v1/model``) and appends
one `HistoryPoint`: events trained, events/s over the last `SPAN_S` of the
workers' reports, the latest windows' progressive log loss / AUC / COPC, lag,
dead letters, features per table, workers, and (given `predict_latency`, a
reading of the API's predict latency histogram) the mean, p50 and p99 latency
of the model's predict requests over the last `SPAN_S`. The newest
`History.max_points` are kept; ``GET /v1/history`` serves them and the
dashboard (``GET /``) draws them::

    async with History(view, model, interval_s=2.0, max_points=1800) as history:
        ...
        history.points(since=t)

A sample that fails is skipped: `History.error` says why (the shards'
error, or the exception a bug raised) until a sample succeeds again, and
each new cause is logged once, one line. The task never ends on an error:
the dashboard keeps drawing and shows `error` (``GET /v1/history``) instead
of a frozen chart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_core.errors import PSError
from ps_core.model.models import Model

from ..background import BackgroundLoop
from ..logs import log_event
from ..status import BoardSummary, WorkerView, board_entry, summarize
from .views import ClusterView, all_stats

__all__ = [
    "History",
    "HistoryPoint",
    "LatencyTotals",
    "latency_between",
    "window_quality",
    "LIVE_WORKER_S",
    "SPAN_S",
    "board_models",
]

log = logging.getLogger("ctrps.history")

LIVE_WORKER_S = 60.0
"""A worker's last window counts in a sample's log loss / AUC / COPC while its
latest report is at most this much older than the board's newest report.
Both times are shard 0's clock, so no clock skew enters; a worker that
stopped drops out after this long, while live workers with windows up to this
long always count."""


SPAN_S = 30.0
"""Events/s and predict latency are measured over (at least) this span, not
between two samples: a worker reports once per window, and windows longer
than the sample interval would make a rate between samples swing between 0
and several times the true rate. Over a span of several windows it is steady."""

MAX_REPORTS_KEPT = 256
"""Reports kept per worker for its rate (a bound; `SPAN_S` of them is fewer)."""


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    """One sample of the cluster (a JSON object in ``GET /v1/history``)."""

    t: float
    """When it was taken (seconds since the epoch, the API's clock)."""
    events_trained: int
    """Events trained, summed over the workers on the board."""
    events_per_s: float | None
    """Events trained per second over the last `SPAN_S` (`History.sample`):
    per worker, its events between two of its reports at least that far apart
    (the previous one when its windows are longer) over the time between
    them, summed over workers; a worker silent for longer than `SPAN_S` and
    three of its report intervals counts 0. None until some worker has
    reported twice while sampled."""
    logloss: float | None
    """Progressive log loss of the live workers' latest windows (mean over
    their events); None before any window."""
    auc: float | None
    """Progressive AUC of the live workers' latest windows (their mean,
    weighted by events: exact for one worker, an approximation for several)."""
    copc: float | None
    """Clicks over predicted clicks of the live workers' latest windows (their
    mean, weighted by events)."""
    lag: int
    """Records behind, all partitions."""
    dead_letters: int
    """Records dead-lettered, summed over workers, all reasons."""
    features: dict[str, int]
    """Features (rows) per table of the model, summed over shards."""
    workers: int
    """Workers of the model on the board (live or not, as ``GET /v1/model`` lists them)."""
    predict_mean_ms: float | None
    """Mean latency of the model's predict requests answered over the last
    `SPAN_S` (since the history started, when it is younger), in
    milliseconds; None when there was none, or without a latency source."""
    predict_p50_ms: float | None
    """Their median in milliseconds, estimated from the latency histogram's
    buckets (`latency_between`); None as `predict_mean_ms`."""
    predict_p99_ms: float | None
    """Their 99th percentile in milliseconds, estimated as `predict_p50_ms`."""


LatencyTotals = tuple[float, float, tuple[tuple[float, float], ...]]
"""A cumulative reading of a latency histogram: requests, their seconds
summed, and per bucket (upper bound in seconds, requests at most that slow),
bounds ascending, the last +inf: Prometheus's ``_count``, ``_sum`` and
``_bucket{le}``."""


def latency_between(before: LatencyTotals, after: LatencyTotals) -> tuple[float | None, float | None, float | None]:
    """The mean, p50 and p99 latency, in milliseconds, of the requests counted
    between two readings of one histogram; (None, None, None) without any.

    Percentiles are estimated as Prometheus's ``histogram_quantile`` does:
    linear within the bucket that holds them, and the highest finite bound
    when that is the +inf bucket (a histogram says nothing above it)."""
    count = after[0] - before[0]
    if count <= 0:  # no request, or a reset histogram: nothing to say
        return None, None, None
    mean_ms = max(0.0, after[1] - before[1]) / count * 1000.0
    earlier = dict(before[2])  # empty before the model's first request
    within = [(bound, cumulative - earlier.get(bound, 0.0)) for bound, cumulative in after[2]]
    return mean_ms, _quantile_ms(within, 0.5 * count), _quantile_ms(within, 0.99 * count)


def _quantile_ms(buckets: list[tuple[float, float]], rank: float) -> float | None:
    """The latency (ms) of the request of `rank` in cumulative `buckets`."""
    lower, below = 0.0, 0.0
    for bound, within in buckets:  # a dozen buckets
        if within >= rank:
            if math.isinf(bound):
                return lower * 1000.0
            share = (rank - below) / (within - below) if within > below else 1.0
            return (lower + (bound - lower) * share) * 1000.0
        lower, below = bound, within
    return None  # buckets without +inf: not a Prometheus histogram


def board_models(statuses: Sequence[object]) -> set[str]:
    """The models the workers on the board (`ControlClient.statuses`) name."""
    return {
        e["status"]["model"]
        for e in map(board_entry, statuses)
        if isinstance(e, dict)
        and isinstance(e.get("status"), dict)
        and e["status"].get("kind") == "worker"
        and isinstance(e["status"].get("model"), str)
    }


def _finite(value: object) -> float | None:
    """A status field as a finite float, or None (the board holds any JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def window_quality(workers: list[WorkerView]) -> dict[str, float | None]:
    """``logloss``, ``auc`` and ``copc`` over the latest windows of the live
    workers (`LIVE_WORKER_S`), each weighted by its window's events; a metric
    no window reports is None."""
    if not workers:
        return {"logloss": None, "auc": None, "copc": None}
    newest = max(w.received_at for w in workers)
    windows = [w.status.get("last_window") for w in workers if w.received_at >= newest - LIVE_WORKER_S]
    out: dict[str, float | None] = {}
    for key in ("logloss", "auc", "copc"):
        pairs = []
        for window in windows:  # one per worker: a handful
            if isinstance(window, dict):
                events, value = _finite(window.get("events")), _finite(window.get(key))
                if events is not None and events > 0 and value is not None:
                    pairs.append((events, value))
        weight = sum(events for events, _ in pairs)
        # Shares first: one worker's figure comes out exactly as it reported it.
        out[key] = sum(value * (events / weight) for events, value in pairs) if pairs else None
    return out


class History(BackgroundLoop):
    """Samples the cluster every `interval_s` and keeps the newest `max_points`.

    `start()` starts the sampling task (the first sample at once), `stop()`
    cancels and awaits it (idempotent); ``async with`` does both. `sample()` is
    one step, for callers that drive it themselves (tests)."""

    task_name = "ctrps-history"

    def __init__(
        self,
        view: ClusterView,
        model: Model,
        *,
        interval_s: float,
        max_points: int,
        clock: Callable[[], float] = time.time,
        predict_latency: Callable[[], LatencyTotals] | None = None,
    ) -> None:
        """The app passes `ApiSettings.history_interval_s` and
        `ApiSettings.history_points`; `clock` gives each point's time, in
        seconds since the epoch; `predict_latency` reads the model's predict
        latency histogram (`ApiMetrics.predict_latency`), None: no latency in
        the points."""
        if not 0 < interval_s < math.inf:
            raise ValueError(f"interval_s must be a positive number of seconds, not {interval_s!r}")
        if max_points < 1:
            raise ValueError(f"max_points must be >= 1, not {max_points!r}")
        self.view = view
        self.model = model
        self.interval_s = interval_s
        self.max_points = max_points
        self.error: str | None = None
        # What `error` is logged by: its kind and where, not its text, which
        # carries how long a shard has been unreachable and so changes.
        self._cause: tuple[str, str | None] | None = None
        """Why the latest sample failed (the shards' error, or an unexpected
        exception's type and message), None after a success."""
        self._clock = clock
        self._predict_latency = predict_latency
        # Readings of the latency histogram, (time, totals), back to one at
        # least SPAN_S old: a point's latency is measured from the oldest. The
        # first is taken now, so the first point covers the requests since
        # the history started.
        self._readings: deque[tuple[float, LatencyTotals]] = deque(maxlen=MAX_REPORTS_KEPT)
        if predict_latency is not None:
            self._readings.append((clock(), predict_latency()))
        # Per worker on the board, its reports as first sampled: (shard 0's
        # time of the report, events trained, this clock's time of the sample).
        self._reports: dict[str, deque[tuple[float, int, float]]] = {}
        self._points: deque[HistoryPoint] = deque(maxlen=max_points)

    @property
    def running(self) -> bool:
        """Whether the sampling task is running."""
        return self._task is not None and not self._task.done()

    def points(self, since: float | None = None) -> list[HistoryPoint]:
        """The points kept, oldest first; with `since`, only those taken after it."""
        if since is None:
            return list(self._points)
        # Newest last: walk back from the end, usually only a point or two.
        newer: list[HistoryPoint] = []
        for p in reversed(self._points):
            if p.t <= since:
                break
            newer.append(p)
        return newer[::-1]

    async def sample(self) -> HistoryPoint | None:
        """Read the cluster once and append a point; returns it, or None when
        the sample failed (`error` says why). Never raises but on cancellation."""
        try:
            stats, board = await asyncio.gather(all_stats(self.view), self.view.statuses())
            latency = None if self._predict_latency is None else self._predict_latency()
            point = self._point(self._clock(), stats, summarize(board, self.model.name), latency)
        except PSError as exc:
            self._failed(f"{exc.code}: {exc.detail}", cause=(exc.code, getattr(exc, "url", None)))
            return None
        except Exception as exc:  # a bug: shown and logged, the sampler goes on
            self._unexpected(exc)
            return None
        self._points.append(point)
        if latency is not None:
            self._readings.append((point.t, latency))
        if self.error is not None:
            log_event(log, "history sampling resumed", points=len(self._points))
            self.error = None
            self._cause = None
        return point

    def _point(
        self, t: float, stats: list[dict[str, Any]], board: BoardSummary, latency: LatencyTotals | None
    ) -> HistoryPoint:
        features = {
            name: sum(int(s["tables"][name]["features"]) for s in stats if name in s["tables"])
            for name in self.model.table_names
        }
        quality = window_quality(board.workers)
        mean_ms, p50_ms, p99_ms = (None, None, None)
        if latency is not None and self._readings:
            readings = self._readings
            while len(readings) > 1 and readings[1][0] <= t - SPAN_S:
                readings.popleft()
            mean_ms, p50_ms, p99_ms = latency_between(readings[0][1], latency)
        return HistoryPoint(
            t=t,
            events_trained=board.events_trained,
            events_per_s=self._rate(t, board.workers),
            logloss=quality["logloss"],
            auc=quality["auc"],
            copc=quality["copc"],
            lag=board.lag,
            dead_letters=board.dead_letters,
            features=features,
            workers=len(board.workers),
            predict_mean_ms=mean_ms,
            predict_p50_ms=p50_ms,
            predict_p99_ms=p99_ms,
        )

    def _rate(self, t: float, workers: list[WorkerView]) -> float | None:
        """Events/s over the last `SPAN_S` of each worker's reports, summed
        (`HistoryPoint.events_per_s`); keeps the reports it needs."""
        kept_by = self._reports
        for gone in kept_by.keys() - {w.source for w in workers}:
            del kept_by[gone]  # off the board: nothing to keep
        total, known = 0.0, False
        for w in workers:  # one per worker: a handful
            events = int(_finite(w.status.get("events_trained")) or 0)
            kept = kept_by.get(w.source)
            if kept is None or (kept and events < kept[-1][1]):  # new, or its totals restarted
                kept = kept_by[w.source] = deque(maxlen=MAX_REPORTS_KEPT)
            if not kept or kept[-1][0] != w.received_at:
                kept.append((w.received_at, events, t))
            # The oldest kept is the newest report at least SPAN_S before the latest.
            while len(kept) > 2 and kept[1][2] <= kept[-1][2] - SPAN_S:
                kept.popleft()
            (_, first, since), (_, last, at) = kept[0], kept[-1]
            if len(kept) < 2 or at <= since:
                continue  # one report: no rate yet
            known = True
            # Times are this clock's, when a sample first saw each report: off
            # by at most one interval over a span of SPAN_S (shard 0's report
            # times would be exact but follow another clock than `t`).
            if t - at <= max(SPAN_S, 3 * (at - since) / (len(kept) - 1)):
                total += (last - first) / (at - since)
            # else: silent for longer than it ever was, it has stopped: it counts 0
        return total if known else None

    def _unexpected(self, exc: Exception) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        self._failed(f"{type(exc).__name__}: {exc}"[:500], where=where)

    def _failed(self, error: str, *, where: str | None = None, cause: tuple[str, str | None] | None = None) -> None:
        # Once per outage (and when its cause changes), not once per sample;
        # one line even for a bug (`where` names the line that raised).
        cause = (error, where) if cause is None else cause
        if cause != self._cause:
            fields = {"error": error} if where is None else {"error": error, "where": where}
            log.warning("history sample failed", extra={"fields": fields})
        self.error = error
        self._cause = cause

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.sample()
            except Exception as exc:  # `sample` catches its own; a subclass's too
                self._unexpected(exc)
            # A fixed cadence; after a sample slower than the interval (shard
            # retries) the next starts at once, not a burst catching up.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
