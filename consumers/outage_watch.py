"""A worker's outages: a shard, the coordinator or the broker unreachable,
waited out (`consumers.outage.OutageWatch`) and counted in its stats; calls
retried across them; its Kafka clients started once the broker listens; and
the broker watched while the worker runs (no window starts while it is
away)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka.errors import KafkaConnectionError, KafkaError

from ps_core.errors import PSError
from ps_core.waits import within

from .broker import broker_listening
from .outage import OutageWatch, began, describe, is_outage, retrying
from .reports import WorkerStats

__all__ = ["Outages", "Stopped", "stop_client"]

log = logging.getLogger("ctrps.worker")

_T = TypeVar("_T")


class Stopped(Exception):
    """A stop request arrived while the worker waited out an outage."""


class Outages:
    """Waits out the outages of a worker reading from `bootstrap`, under
    `watch`'s deadline, counting them in `stats`. `probe_shards` returns once
    every shard (and the coordinator) answers again."""

    def __init__(
        self, bootstrap: str, watch: OutageWatch, stats: WorkerStats, probe_shards: Callable[[], Awaitable[None]]
    ) -> None:
        self.bootstrap = bootstrap
        self.watch = watch
        self.stats = stats
        self.probe_shards = probe_shards
        self.stop = asyncio.Event()
        """Set to stop the worker: a stoppable wait then ends with `Stopped`."""
        self.broker_down = False
        """Set while the broker is unreachable: no window starts training."""

    async def probe_broker(self) -> None:
        """Return if something listens at the bootstrap address."""
        if not await broker_listening(self.bootstrap):
            raise KafkaConnectionError(f"nothing listening at {self.bootstrap}")

    def probe_for(self, exc: BaseException) -> Callable[[], Awaitable[None]]:
        """The probe of what the outage `exc` waits for: the shards or the broker."""
        return self.probe_shards if isinstance(exc, PSError) else self.probe_broker

    async def ride_out(
        self, exc: BaseException, probe: Callable[[], Awaitable[object]], since: float, *, stoppable: bool = True
    ) -> None:
        """Wait until `probe` succeeds after the outage `exc` (seen at `since`,
        or begun earlier where `exc` says: `began`), counting it;
        `OutageDeadlineError` past the deadline. When `stoppable`, a stop
        request ends the wait with `Stopped`."""
        what = describe(exc, self.bootstrap)
        since = began(exc, since)  # the first unanswered request, not when its failure was seen
        s = self.stats
        s.outages += 1
        s.waiting_for = what
        wait = asyncio.create_task(self.watch.wait(what, probe, since))
        stopping = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({wait, stopping} if stoppable else {wait}, return_when=asyncio.FIRST_COMPLETED)
            if not wait.done():
                log.info(
                    "stop asked while waiting: nothing more is trained or committed",
                    extra={"fields": {"waiting_for": what}},
                )
                raise Stopped()
            s.outage_seconds += wait.result()
        finally:
            s.waiting_for = ""
            for t in (wait, stopping):
                t.cancel()
            await asyncio.gather(wait, stopping, return_exceptions=True)

    async def retrying(self, op: Callable[[], Awaitable[_T]], *, broker: bool = False) -> _T:
        """`op()`, waiting out the shards' (or, with `broker`, the broker's)
        outages between attempts; any other failure is raised."""
        probe = self.probe_broker if broker else self.probe_shards

        async def wait(exc: Exception, since: float) -> None:
            if not is_outage(exc):
                raise exc
            await self.ride_out(exc, probe, since)

        return await retrying(op, wait)

    async def until_listening(self) -> None:
        """Return once something listens at the bootstrap address (probed
        first: the Kafka client would log every attempt)."""
        since = time.monotonic()
        if not await broker_listening(self.bootstrap):
            await self.ride_out(KafkaConnectionError(), self.probe_broker, since)

    async def start_kafka(self, make: Callable[[], Any], hold: Callable[[Any], None]) -> None:
        """Start an aiokafka client from `make()`, waiting while nothing
        listens at the bootstrap address (one line every few seconds, not the
        client's own lines per attempt).

        `hold(client)` is called before the client starts (and `hold(None)`
        if it fails): a consumer may join its group, and call the rebalance
        listener, before `start` returns."""
        while True:
            since = time.monotonic()
            await self.until_listening()
            made = make()
            hold(made)
            try:
                await made.start()
                return
            except KafkaError as exc:
                hold(None)
                with contextlib.suppress(Exception):
                    await within(made.stop(), 10)
                if not is_outage(exc):
                    raise
                await self.ride_out(exc, self.probe_broker, since)

    async def watch_broker(self, came_back: Callable[[], Awaitable[bool]]) -> None:
        """While the worker runs: probe the broker every second; while it is
        unreachable, no window starts training (`broker_down`), and one line
        every few seconds says so. Once it is back, `came_back()` says whether
        windows must still wait (the broker is another cluster now: the
        consume loop clears `broker_down` once it has moved). Raises
        `OutageDeadlineError` past the deadline."""
        while True:
            await asyncio.sleep(self.watch.probe_every_s)
            since = time.monotonic()
            if await broker_listening(self.bootstrap):
                continue
            self.broker_down = True
            moved = False
            try:
                await self.ride_out(KafkaConnectionError(), self.probe_broker, since, stoppable=False)
                moved = await came_back()
            finally:
                self.broker_down = moved


async def stop_client(client: Any) -> None:
    """Stop an aiokafka client, within 15 s. With the broker gone, the
    consumer's fetcher raises from `stop` the cancellation of its own fetch
    tasks: swallowed, unless this task itself is being cancelled."""
    try:
        await within(client.stop(), 15)
    except (TimeoutError, KafkaError):
        pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
