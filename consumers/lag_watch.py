"""Watching a worker's consumer lag: a warning when it keeps growing.

A worker that trains slower than its records arrive falls further behind
every window, and nothing fails: no outage, no error. `LagWatch` is fed the
worker's total lag every few seconds (`observe`: the broker's end offsets
less the worker's commits, asked of the broker, since the consumer's own
highwater is only refreshed once its fetched records are used up, which
takes many windows when it is behind) and where each window's time went
(`window`), and says, in one WARNING
line, when the lag has been growing for longer than ``--lag-warn-seconds``:
how far behind, for how long, the events trained per second against the
records arriving per second, and the likely cause (the stage that took the
largest share of the time, see `Stage`). The line repeats once per
``--lag-warn-seconds`` while the growth lasts; one INFO line says when it
stops. The seconds of growth and the warnings are the worker's status
(``lag_growing_seconds``, ``lag_warnings``), hence metrics.

*Growing* is judged against the lag a horizon ago (a quarter of the warning
time, at most 30 s), not against the sample before: the lag moves by a
window's records at each commit either way, and a steady lag, however
large, is not growing. The clock is the caller's (`observe`'s `now`), so the
class is tested without a broker.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LagWatch", "LagNotice", "WindowTimes", "Stage", "STAGES"]

HORIZON_MAX_S = 30.0
"""The longest a lag is compared back (growth is lag now > lag this long ago)."""


@dataclass(frozen=True)
class WindowTimes:
    """Where one window's wall time went (seconds)."""

    seconds: float
    """The whole window: decode waits, training, dead letters, lease and commit."""
    decode_wait_s: float = 0.0
    """Training waited for the window's records to be decoded."""
    train_s: float = 0.0
    """Training, without the decode waits: computation and the shards' round trips."""
    train_cpu_s: float = 0.0
    """The worker process's CPU time while training: what of `train_s` was not waiting."""


@dataclass(frozen=True)
class Stage:
    """A place the time can go, and what it means when it is the largest."""

    key: str
    cause: str


STAGES = (
    Stage("shards", "pulls and pushes waited on the shards: the shards or the link to them are slow"),
    Stage("decode", "training waited for decoding: decoding is CPU-bound, add --decode-processes or CPU"),
    Stage("compute", "training computation: this worker's CPU is the limit, add workers (and partitions)"),
    Stage("commit", "dead letters, lease and offset commit: the broker or the coordinator is slow"),
    Stage("fetch", "waiting for records between windows: fetching from the broker (or the link to it) is slow"),
)
"""Where the time goes (`_Totals.shares`), in the order a tie is reported."""


@dataclass(frozen=True)
class LagNotice:
    """A line to log: the growth warned about, or its end."""

    level: int
    message: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class _Sample:
    t: float
    lag: int
    records: int
    events: int
    totals: _Totals


@dataclass(frozen=True)
class _Totals:
    """Running sums of window times since the watch started (or was reset)."""

    windows_s: float = 0.0
    decode_s: float = 0.0
    shards_s: float = 0.0
    compute_s: float = 0.0
    commit_s: float = 0.0

    def plus(self, w: WindowTimes) -> _Totals:
        train = max(0.0, w.train_s)
        compute = min(max(0.0, w.train_cpu_s), train)
        return _Totals(
            self.windows_s + max(0.0, w.seconds),
            self.decode_s + max(0.0, w.decode_wait_s),
            self.shards_s + train - compute,
            self.compute_s + compute,
            self.commit_s + max(0.0, w.seconds - w.decode_wait_s - train),
        )

    def minus(self, other: _Totals) -> _Totals:
        return _Totals(
            self.windows_s - other.windows_s,
            self.decode_s - other.decode_s,
            self.shards_s - other.shards_s,
            self.compute_s - other.compute_s,
            self.commit_s - other.commit_s,
        )

    def shares(self, elapsed_s: float, running_s: float, basis: _Totals) -> dict[str, float]:
        """Each stage's share of `elapsed_s`, in which these windows ended and
        one ran for `running_s` without ending yet. The time in windows is
        split as `basis`'s was (these windows', or earlier ones' when none
        ended: a window can outlast the horizon); the rest, between windows,
        is the fetch's."""
        if elapsed_s <= 0:
            return {s.key: 0.0 for s in STAGES}
        busy = min(elapsed_s, self.windows_s + running_s)
        per = busy / basis.windows_s if basis.windows_s > 0 else 0.0
        spent = {
            "shards": basis.shards_s * per,
            "decode": basis.decode_s * per,
            "compute": basis.compute_s * per,
            "commit": basis.commit_s * per,
            "fetch": elapsed_s - busy if per else elapsed_s,
        }
        return {k: min(1.0, max(0.0, v / elapsed_s)) for k, v in spent.items()}


@dataclass
class LagWatch:
    """Says when a worker's total lag has been growing for `warn_after_s`
    (0: never). Feed it every window with `observe`."""

    warn_after_s: float
    """How long the lag must grow before the warning."""
    horizon_s: float = 0.0
    """Growth is judged against the lag this long ago (0: a quarter of
    `warn_after_s`, at most `HORIZON_MAX_S`)."""
    warnings: int = 0
    """Warnings logged so far."""
    _samples: deque[_Sample] = field(default_factory=deque)
    _totals: _Totals = field(default_factory=_Totals)
    _partitions: frozenset[int] = frozenset()
    _start: _Sample | None = None
    _warned_at: float | None = None
    _growing_s: float = 0.0
    _window_began: float | None = None

    def __post_init__(self) -> None:
        if not self.warn_after_s >= 0:
            raise ValueError("lag warn seconds must be >= 0 (0: off)")
        if self.horizon_s <= 0:
            self.horizon_s = min(HORIZON_MAX_S, self.warn_after_s / 4)

    @property
    def every_s(self) -> float:
        """How often the lag is best sampled: four samples a horizon, at most every 5 s."""
        return min(5.0, self.horizon_s / 4)

    @property
    def growing_s(self) -> float:
        """Seconds the lag had been growing at the last `observe` (0: not growing)."""
        return self._growing_s

    def window_began(self, now: float) -> None:
        """A window began applying at `now` (the clock of `observe`)."""
        self._window_began = now

    def window(self, times: WindowTimes) -> None:
        """A window ended; `times`, where its time went."""
        self._totals = self._totals.plus(times)
        self._window_began = None

    def reset(self) -> None:
        """Forget the samples (an outage: it has lines and metrics of its own,
        and nothing before it compares with what follows)."""
        self._samples.clear()
        self._start, self._warned_at, self._growing_s = None, None, 0.0

    def observe(self, now: float, lag: int, records: int, events: int, partitions: frozenset[int]) -> LagNotice | None:
        """At `now` (seconds, any monotonic clock) the worker is `lag` records
        behind over `partitions`, after `records` consumed and `events`
        trained in all. Returns the line to log, if any."""
        if self.warn_after_s <= 0:
            return None
        if partitions != self._partitions:
            # Another assignment: its lag is over other partitions, so
            # nothing before it compares.
            self._partitions = partitions
            self.reset()
        now_sample = _Sample(now, lag, records, events, self._totals)
        samples = self._samples
        samples.append(now_sample)
        # Keep the latest sample at least a horizon old, and every later one.
        while len(samples) > 2 and samples[1].t <= now - self.horizon_s:
            samples.popleft()
        ref = samples[0]
        if ref is now_sample or lag <= ref.lag:
            return self._stopped(now_sample)
        if self._start is None:
            self._start = ref  # lower then, higher since
        start = self._start
        self._growing_s = now - start.t
        if self._growing_s < self.warn_after_s:
            return None
        if self._warned_at is not None and now - self._warned_at < self.warn_after_s:
            return None
        self._warned_at = now
        self.warnings += 1
        return self._warning(start, now_sample)

    def _stopped(self, now: _Sample) -> LagNotice | None:
        """The lag is not growing (any more): the end line if it was warned about."""
        start, warned = self._start, self._warned_at is not None
        self._start, self._warned_at, self._growing_s = None, None, 0.0
        if start is None or not warned:
            return None
        grew = now.t - start.t
        return LagNotice(
            logging.INFO,
            f"consumer lag no longer growing after {grew:.0f}s: {now.lag} records behind",
            {"lag": now.lag, "lag_grew_s": round(grew, 1)},
        )

    def _warning(self, start: _Sample, now: _Sample) -> LagNotice:
        dt = now.t - start.t
        consumed = now.records - start.records
        trained = (now.events - start.events) / dt
        # Records that arrived = those consumed + the growth of the lag.
        arriving = (consumed + now.lag - start.lag) / dt
        ended = now.totals.minus(start.totals)
        began = self._window_began
        running = now.t - max(began, start.t) if began is not None else 0.0
        shares = ended.shares(dt, max(0.0, running), ended if ended.windows_s > 0 else now.totals)
        worst = max(STAGES, key=lambda s: shares[s.key])
        return LagNotice(
            logging.WARNING,
            f"consumer lag growing for {dt:.0f}s: {now.lag} records behind (was {start.lag}); "
            f"training {trained:.0f} events/s while records arrive at {arriving:.0f}/s; "
            f"likely cause ({shares[worst.key]:.0%} of the time): {worst.cause}",
            {
                "lag": now.lag,
                "lag_was": start.lag,
                "lag_growing_s": round(dt, 1),
                "events_per_s": round(trained, 1),
                "arriving_per_s": round(arriving, 1),
                "cause": worst.key,
                **{f"{k}_share": round(v, 3) for k, v in shares.items()},
            },
        )
