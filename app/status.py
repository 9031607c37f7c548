"""Worker status: what a training worker leaves on the shards' status board
after each window, and the summary the API reads back from it.

Workers run in other processes than the API (or in the same one, in the demo);
the board on shard 0 (`ps_core.shard.Shard.report_status`) is where they meet.
A worker reports one JSON object per window (`worker_status`), holding
cumulative totals, so a lost report loses nothing but freshness::

    worker = Worker(config, client, control, model)
    worker.on_window = make_status_hook(control, default_worker_id(), worker.stats)

The API summarises the board (`summarize`) for ``GET /v1/model`` and
``/metrics``: totals summed over workers, the last window of the most recent
report, and lag per partition from the most recent report naming it.
"""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from consumers.worker import WindowReport, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.net.control_messages import BoardEntry
from ps_core.parsing import is_int_text
from ps_core.store.board import as_worker_status

__all__ = [
    "WINDOW_SECONDS_BUCKETS",
    "SecondsHistogram",
    "worker_status",
    "make_status_hook",
    "StatusHook",
    "default_worker_id",
    "WorkerView",
    "BoardSummary",
    "summarize",
]

log = logging.getLogger("ctrps.worker")

WINDOW_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the window-duration histogram; +Inf is implied."""


@dataclass
class SecondsHistogram:
    """A cumulative histogram of window durations, kept by the status hook
    (a worker's own stats keep only recent windows)."""

    bounds: tuple[float, ...] = WINDOW_SECONDS_BUCKETS
    """Bucket upper bounds, increasing; a last bucket (+Inf) follows."""
    counts: list[int] = field(default_factory=list)
    """Observations per bucket (not cumulative), ``len(bounds) + 1`` of them."""
    total: float = 0.0
    """Sum of the observations."""

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        """Count one window of `seconds`."""
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def to_dict(self) -> dict[str, Any]:
        """``{"bounds", "counts", "sum", "count"}`` (JSON-ready)."""
        return {
            "bounds": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.total,
            "count": sum(self.counts),
        }


def worker_status(
    report: WindowReport | None,
    stats: WorkerStats,
    *,
    window_seconds: SecondsHistogram | None = None,
    update_mode: str = "async",
    started_at: float | None = None,
    wire: Mapping[str, Any] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """A worker's status after the window of `report` (a JSON object).

    Totals come from `stats` (cumulative since the worker started), the last
    window from `report` (None: no window yet, no ``last_window``); lag per
    partition is keyed by the partition number as a string (JSON object keys
    are strings). A mode's own counts are reported by its workers only (sync
    steps, geo rounds), so a summary tells a mode's zero from another mode.

    Every field must be declared by the board's schema
    (`ps_core.store.board.WorkerStatus`): the board refuses a status with an
    unknown field whole."""
    status: dict[str, Any] = {
        "kind": "worker",
        "update_mode": update_mode,
        "reported_at": time.time(),
        "windows": stats.windows,
        "records_consumed": stats.records,
        "events_trained": stats.events_trained,
        "dead_letters": stats.dead_letters,
        "dead_letters_by_reason": dict(stats.dead_letters_by_reason),
        "commits": stats.commits,
        "failed_commits": stats.failed_commits,
        "late_commit_failures": stats.late_commit_failures,
        # {reason: {action: partitions}}: resume offsets not applied as given.
        "stale_offsets": _nested(stats.stale_offsets),
        "outages": stats.outages,
        "outage_seconds": round(stats.outage_seconds, 3),
        "windows_replayed": stats.windows_replayed,
        # Seconds the lag has kept growing (0: it is not), and the warnings said so.
        "lag_growing_seconds": round(stats.lag_growing_s, 3),
        "lag_warnings": stats.lag_warnings,
        "rewinds": stats.rewinds,
        **({"sync_steps": stats.sync_steps} if update_mode == "sync" else {}),
        **(
            {"geo_rounds": stats.geo_rounds, "geo_full_refreshes": stats.geo_full_refreshes}
            if update_mode == "geo"
            else {}
        ),
    }
    if report is not None:
        last = report.fields()
        last["seconds"] = report.seconds
        status["last_window"] = last
        status["lag_by_partition"] = {str(p): int(n) for p, n in report.lag_by_partition.items()}
    if started_at is not None:
        status["started_at"] = started_at
    if window_seconds is not None:
        status["window_seconds"] = window_seconds.to_dict()
    if wire is not None:
        status["wire"] = dict(wire)
    if model is not None:
        status["model"] = model
    return status


def _nested(counts: Mapping[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (reason, action), n in counts.items():
        out.setdefault(reason, {})[action] = int(n)
    return out


class StatusHook:
    """An ``on_window`` hook for `consumers.worker.Worker` that reports the
    worker's status to the board of shard 0 under `worker_id` after each window
    (`make_status_hook`).

    It keeps the histogram of window durations, and counts the reports the
    board took (`sent`) and those it did not (`lost`: shard 0 unreachable, or
    the status refused). A lost report is one warning line naming the cause,
    the window and how long reports have been lost: that window is missing from
    the API's ``/v1/model``, ``/metrics`` and the dashboard (the next report's
    totals carry it). Training goes on either way."""

    def __init__(
        self,
        control: ControlClient,
        worker_id: str,
        stats: WorkerStats,
        *,
        update_mode: str = "async",
        wire: Callable[[], Mapping[str, Any]] | None = None,
        model: str | None = None,
    ) -> None:
        self.control = control
        self.worker_id = worker_id
        self.stats = stats
        self.update_mode = update_mode
        self.model = model
        self._wire = wire
        self.histogram = SecondsHistogram()
        self.started_at = time.time()
        self.sent = 0
        """Reports the board took."""
        self.lost = 0
        """Reports the board did not take."""
        self.sent_at: float | None = None
        """When the board last took a report (seconds since the epoch), None before."""
        self._losing_since: float | None = None  # monotonic time of the first of the current run of losses
        self._losing = 0

    def status(self, report: WindowReport | None) -> dict[str, Any]:
        """The status as of `report` (None: no window yet), as it is reported."""
        return worker_status(
            report,
            self.stats,
            window_seconds=self.histogram,
            update_mode=self.update_mode,
            started_at=self.started_at,
            wire=None if self._wire is None else self._wire(),
            model=self.model,
        )

    async def __call__(self, report: WindowReport) -> None:
        self.histogram.observe(report.seconds)
        status = self.status(report)
        try:
            await self.control.report_status(self.worker_id, as_worker_status(status))
        except Exception as exc:  # the board's failure, never training's
            self._report_lost(report, exc)
            return
        self.sent += 1
        self.sent_at = time.time()
        if self._losing:
            log.info(
                "status reports resumed",
                extra={"fields": {"worker": self.worker_id, "lost": self._losing, "lost_for_s": self._lost_for()}},
            )
            self._losing, self._losing_since = 0, None

    def _lost_for(self) -> float:
        return 0.0 if self._losing_since is None else round(time.monotonic() - self._losing_since, 1)

    def _report_lost(self, report: WindowReport, exc: Exception) -> None:
        self.lost += 1
        self._losing += 1
        if self._losing_since is None:
            self._losing_since = time.monotonic()
        log.warning(
            "status report lost: this window is missing from the API's /v1/model, /metrics and dashboard",
            extra={
                "fields": {
                    "worker": self.worker_id,
                    "model": self.model or "-",
                    "window": report.window,
                    "error": repr(exc),
                    "lost_in_a_row": self._losing,
                    "lost_for_s": self._lost_for(),
                }
            },
        )


def make_status_hook(
    control: ControlClient,
    worker_id: str,
    stats: WorkerStats,
    *,
    update_mode: str = "async",
    wire: Callable[[], Mapping[str, Any]] | None = None,
    model: str | None = None,
) -> StatusHook:
    """An ``on_window`` hook for `consumers.worker.Worker` that reports the
    worker's status to the board of shard 0 under `worker_id` after each window
    (`StatusHook`).

    `stats` is the worker's own `WorkerStats` (``worker.stats``); the hook
    keeps the histogram of window durations itself. `wire` gives what the
    worker's frames cost so far (`ps_core.net.wire.WireStats`) and their format;
    `model`, the name of the model it trains (an API counts only its own model's workers)."""
    return StatusHook(control, worker_id, stats, update_mode=update_mode, wire=wire, model=model)


def default_worker_id() -> str:
    """``<host>-<pid>-<random>``: unique per worker process, so a restarted
    worker starts a new entry instead of resetting another's totals."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


# -- reading the board ----------------------------------------------------------


def _count(value: object) -> int:
    """A non-negative whole count from a status field; anything else is 0.

    The board stores only statuses of its schema (`ps_core.store.board`), but a
    summary never trusts a field's type: a board is whatever shard 0 says."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return 0
    return int(min(value, 2**63 - 1))


@dataclass(frozen=True)
class WorkerView:
    """One worker's entry on the board."""

    source: str
    """The worker's id."""
    received_at: float
    """When shard 0 received its latest status (shard clock, seconds)."""
    status: dict[str, Any]
    """Its latest status (`worker_status`)."""


@dataclass(frozen=True)
class BoardSummary:
    """The workers' statuses, combined."""

    workers: list[WorkerView]
    """Entries whose status is a worker's, least recently reported first."""
    records_consumed: int
    """Kafka records consumed, summed over workers."""
    events_trained: int
    """Events trained, summed over workers."""
    windows: int
    """Windows trained, summed over workers."""
    dead_letters_by_reason: dict[str, int]
    """Dead letters per reason, summed over workers."""
    lag_by_partition: dict[int, int]
    """Records behind per partition, each from the latest report naming it."""
    last_window: dict[str, Any] | None
    """The last window of the most recent report (None before any)."""
    update_mode: str | None
    """The update mode of the most recent report (None before any)."""

    @property
    def dead_letters(self) -> int:
        """Dead letters, all reasons."""
        return sum(self.dead_letters_by_reason.values())

    @property
    def lag(self) -> int:
        """Records behind, all partitions."""
        return sum(self.lag_by_partition.values())


def board_entry(entry: object) -> object:
    """A board entry (`BoardEntry`, or any decoded JSON) as a JSON object would read."""
    return msgspec.structs.asdict(entry) if isinstance(entry, BoardEntry) else entry


def summarize(statuses: Sequence[object], model: str | None = None) -> BoardSummary:
    """Combine the board (`ControlClient.statuses`, least recently reported first).

    Entries that are not worker statuses are left out, and with `model` the
    workers of another model (a worker that names none, from before workers
    named theirs, counts); fields of the wrong type count as absent. Never
    raises, whatever the board holds: the API's model, metrics and dashboard
    all read it."""
    workers = [
        WorkerView(e["source"], float(e["received_at"]), e["status"])
        for e in map(board_entry, statuses)
        if isinstance(e, dict)
        and isinstance(e.get("source"), str)
        and isinstance(e.get("received_at"), (int, float))
        and not isinstance(e.get("received_at"), bool)
        and isinstance(e.get("status"), dict)
        and e["status"].get("kind") == "worker"
        and (model is None or e["status"].get("model", model) == model)
    ]
    reasons: dict[str, int] = {}
    lag: dict[int, int] = {}
    for w in workers:  # per worker (the board holds at most a few hundred)
        by_reason = w.status.get("dead_letters_by_reason")
        if isinstance(by_reason, dict):
            for reason, n in by_reason.items():
                reasons[reason] = reasons.get(reason, 0) + _count(n)
        by_partition = w.status.get("lag_by_partition")
        if isinstance(by_partition, dict):
            # Later entries are more recent: a partition's latest report wins.
            # ASCII digits only: "³".isdigit() is true, int("³") is an error.
            lag.update({int(p): _count(n) for p, n in by_partition.items() if is_int_text(p)})
    latest = workers[-1].status if workers else None
    last_window = latest.get("last_window") if latest is not None else None
    mode = latest.get("update_mode") if latest is not None else None
    return BoardSummary(
        workers=workers,
        records_consumed=sum(_count(w.status.get("records_consumed")) for w in workers),
        events_trained=sum(_count(w.status.get("events_trained")) for w in workers),
        windows=sum(_count(w.status.get("windows")) for w in workers),
        dead_letters_by_reason=reasons,
        lag_by_partition=dict(sorted(lag.items())),
        last_window=last_window if isinstance(last_window, dict) else None,
        update_mode=mode if isinstance(mode, str) else None,
    )
