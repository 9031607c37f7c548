"""The sync mode's barrier: workers of a model meet at each training step.

In sync mode every member pushes its step's gradients (the shards hold them
apart, `ps_core.store.table.SparseTable.pending`), then *arrives*; when every
member has arrived the step closes and each shard applies the sum of what
it holds, once (`Shard.apply_step`). Members are the workers inside a window:
a worker joins when its window starts training and leaves when it ends, so a
worker waiting for records never holds the others up.

A member that has not arrived `deadline_s` after the step's first arrival
(dead, stuck, or slower than the deadline) is dropped from the quorum: the
step closes without it, counted and logged once. Its pushes are never lost:
what a shard holds is applied at the next step that closes. A dropped member
that arrives later rejoins at the step then open.

`SyncBarrier` is pure asyncio, hosted by the coordinator's shard (shard 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["SyncBarrier", "MAX_DEADLINE_S"]

MAX_DEADLINE_S = 60.0
"""The longest deadline a step may be given (a worker's ``--sync-deadline``)."""

log = logging.getLogger("ctrps.sync")


class SyncBarrier:
    """Steps of the workers inside a window, closed when all have arrived
    or the deadline passed."""

    def __init__(self, max_deadline_s: float = MAX_DEADLINE_S) -> None:
        self.max_deadline_s = max_deadline_s
        """The longest a step waits, whatever deadline its first arrival asked."""
        # Step numbers start at the clock's microseconds, so a restarted
        # coordinator's steps still exceed what shards applied before
        # (`Shard.apply_step` applies a step above its last only).
        self.step = time.time_ns() // 1000
        """The open step."""
        self.members: set[str] = set()
        self.arrived: set[str] = set()
        self._closed: asyncio.Future[int] | None = None
        self._first_arrival = 0.0
        self._deadline = 0.0
        """The open step's deadline, from its first arrival's (capped)."""
        self.steps_closed = 0
        self.shrinks = 0
        """Steps closed without every member (the deadline passed)."""
        self.dropped: dict[str, int] = {}
        """Times each member was dropped from the quorum."""

    def join(self, member: str) -> int:
        """`member` takes part from the open step on; returns that step."""
        self.members.add(member)
        return self.step

    def leave(self, member: str) -> None:
        """`member` takes no part in steps any more; the open step closes if
        everyone left in it has arrived."""
        self.members.discard(member)
        self.arrived.discard(member)
        if self.arrived and self.arrived >= self.members:
            self._close()

    async def arrive(self, member: str, deadline_s: float) -> int:
        """`member` has pushed its gradients for the open step: wait until the
        step closes and return its number. The first arrival's `deadline_s`
        bounds the step."""
        self.members.add(member)  # a dropped member rejoins here
        self.arrived.add(member)
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
            self._first_arrival = time.monotonic()
            self._deadline = min(deadline_s, self.max_deadline_s)
        closed = self._closed
        if self.arrived >= self.members:
            self._close()
        if not closed.done():
            remaining = self._first_arrival + self._deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, remaining)):
                    await asyncio.shield(closed)
            except TimeoutError:
                if not closed.done():
                    self._shrink()
        return closed.result()

    def _shrink(self) -> None:
        late = sorted(self.members - self.arrived)
        for m in late:
            self.dropped[m] = self.dropped.get(m, 0) + 1
        self.members -= set(late)
        self.shrinks += 1
        log.warning(
            "sync step closed without members that did not arrive within the deadline",
            extra={"fields": {"step": self.step, "dropped": ",".join(late), "members": len(self.members)}},
        )
        self._close()

    def _close(self) -> None:
        closed, self._closed = self._closed, None
        step = self.step
        self.step += 1
        self.steps_closed += 1
        self.arrived = set()
        if closed is not None and not closed.done():
            closed.set_result(step)

    def stats(self) -> dict[str, Any]:
        """JSON-ready: the open step, members, steps closed, shrinks, drops."""
        return {
            "step": self.step,
            "members": sorted(self.members),
            "steps_closed": self.steps_closed,
            "shrinks": self.shrinks,
            "dropped": dict(self.dropped),
        }
