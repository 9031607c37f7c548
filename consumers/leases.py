"""A worker's leases from the coordinator (`ps_core.checkpoint.control`): one
per window, held across its pushes and its commit, so that a cut holds the
whole window and its offsets, or neither. A lease's epoch says which
coordinator granted it: a new one (`CoordinatorRestarted`) makes the worker
rewind to what that coordinator's shards hold."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ps_core.checkpoint.control import ControlClient, LeaseGrant
from ps_core.checkpoint.coordinator import Offsets
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.errors import CutInProgressError, NoCoordinatorError, PSError

from .reports import WorkerStats

__all__ = ["LEASE_WAIT_S", "CoordinatorRestarted", "Leases"]

log = logging.getLogger("ctrps.worker")

LEASE_WAIT_S = 5.0
"""How long one lease request waits for a cut to end: well inside the
client's deadline (10 s), so the answer always reaches the worker."""

CUT = "a cut to finish"
"""What a worker waits for while a cut pauses its leases (`WorkerStats.waiting_for`)."""


class CoordinatorRestarted(Exception):
    """A lease came from a coordinator other than the one before (its epoch
    changed): the worker rewinds to that coordinator's offsets."""

    def __init__(self, epoch: str) -> None:
        super().__init__(f"coordinator epoch is now {epoch}")
        self.epoch = epoch


class Leases:
    """The leases of one worker (`worker_id`), each living `ttl_s` unless
    renewed; a cut's pause is counted in `stats` as an outage."""

    def __init__(
        self, control: ControlClient, worker_id: str, ttl_s: float, stats: WorkerStats, log_every_s: float = 5.0
    ) -> None:
        self.control = control
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        """A lease lives the group's session timeout unless renewed: a dead
        worker's lease stops holding a cut when its group drops it."""
        self.stats = stats
        self.log_every_s = log_every_s
        self.leased = False
        """Whether windows are leased from a coordinator (found at start: `found`)."""
        self.epoch: str | None = None
        """The epoch of the coordinator that granted the last lease."""

    async def discover(
        self, retrying: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]], *, needed: bool
    ) -> None:
        """Find whether there is a coordinator, and its epoch, by an empty
        lease (asked through `retrying`): with one, every window is leased
        from now on. Without one, `NoCoordinatorError` when it is `needed`
        (sync mode's barrier), else one line."""
        try:
            grant: LeaseGrant = await retrying(self.grant)
            await retrying(lambda: self.control.release_lease(grant.lease_id, {}))
            self.epoch, self.leased = grant.epoch, True
        except NoCoordinatorError:
            if needed:
                raise NoCoordinatorError(
                    "sync mode needs the coordinator's barrier, and shard 0 hosts no coordinator "
                    "(shard 0 runs with --no-exports; start it with an exports directory, or run --mode async)"
                ) from None
            log.info("no coordinator: windows are not leased and exports hold no offsets")

    async def grant(self) -> LeaseGrant:
        """A lease; while a cut pauses, asks again, one line every few
        seconds saying what the cut waits for (the coordinator's words)."""
        since = time.monotonic()
        next_line = since
        waited = False
        try:
            while True:
                try:
                    return await self.control.acquire_lease(self.worker_id, wait_s=LEASE_WAIT_S, ttl_s=self.ttl_s)
                except CutInProgressError as exc:
                    # Short waits keep every answer within the client's
                    # deadline, so no lease is granted to a caller that has
                    # given up. A cut pauses at most until the leases it
                    # waits for end.
                    if not waited:  # counted as an outage (its metrics), named as the cut
                        self.stats.outages += 1
                        waited = True
                    self.stats.waiting_for = CUT
                    now = time.monotonic()
                    if now >= next_line:
                        next_line = now + self.log_every_s
                        log.warning(
                            f"waiting for {CUT} for {now - since:.0f}s: {exc.detail}; not training or committing",
                            extra={"fields": {"waiting_for": CUT, "waited_s": round(now - since, 1)}},
                        )
        finally:
            if waited:
                self.stats.outage_seconds += time.monotonic() - since
            if self.stats.waiting_for == CUT:
                self.stats.waiting_for = ""

    async def probe(self) -> None:
        """Return once the coordinator grants a lease (released at once). The
        epoch is not taken here: a new coordinator is found by the next
        window's lease, which rewinds."""
        grant = await self.control.acquire_lease(self.worker_id, wait_s=1.0, ttl_s=self.ttl_s)
        await self.control.release_lease(grant.lease_id, {})

    async def take(self) -> int:
        """A window's lease; `CoordinatorRestarted` (the lease released) when
        another coordinator than the last one granted it."""
        grant = await self.grant()
        if self.epoch is not None and grant.epoch != self.epoch:
            # A new coordinator: the shards may hold an older cut than this
            # worker's commits. Train nothing more from where we are.
            await self.release(grant.lease_id, {})
            raise CoordinatorRestarted(grant.epoch)
        self.epoch = grant.epoch
        return grant.lease_id

    async def renewing(self, lease_id: int) -> None:
        """Renew a lease every third of its time to live while its window
        trains (cancelled at its release)."""
        failed = False
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                if not await self.control.renew_lease(lease_id):
                    log.warning(
                        "lease expired while its window trained: a cut may hold part of the window",
                        extra={"fields": {"lease": lease_id}},
                    )
                    return
            except PSError as exc:  # shard 0 unreachable: the window's own calls wait it out
                if not failed:  # once per lease
                    log.warning("lease renewal failed", extra={"fields": {"lease": lease_id, "error": str(exc)}})
                failed = True

    async def release(
        self,
        lease_id: int,
        committed: Offsets,
        *,
        stream: StreamIdentity | None = None,
        model: str | None = None,
        also: list[str] | None = None,
    ) -> None:
        """Release a lease, reporting the offsets its window committed (read
        by `stream`, for `model` and the models trained beside it). A failure
        is logged: the window is committed (or failed) either way."""
        try:
            if not await self.control.release_lease(lease_id, committed, stream=stream, model=model, also=also or []):
                log.warning("lease expired", extra={"fields": {"lease": lease_id}})
        except PSError as exc:
            # A cut gives up on the lease when it expires, and the committed
            # offsets are the group's.
            log.warning("lease release failed", extra={"fields": {"lease": lease_id, "error": str(exc)}})
