"""What the API reads of the cluster besides weights: each shard's stats and
the status board.

The API serves either a training cluster, whose control plane answers
(`ControlView` over a `ControlClient`), or a serving replica's exports
(`app.api.follower.ReplicaView`), which has no control plane and no board.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgspec

from ps_core.checkpoint.control import ControlClient
from ps_core.errors import PSError
from ps_core.net.control_messages import BoardEntry

from ..metrics import ApiMetrics

__all__ = ["ClusterView", "ControlView"]


class ClusterView(Protocol):
    """The read-only observations the API makes of its shards."""

    num_shards: int

    async def stats_each(self) -> list[dict[str, Any] | PSError]:
        """Each shard's stats, or the error it answered with, in shard order."""
        ...

    async def statuses(self) -> list[BoardEntry]:
        """The status board, the least recently reported first."""
        ...


class ControlView:
    """A training cluster's stats and board through its control plane, each
    shard's stats call timed in `metrics` (op ``stats``)."""

    def __init__(self, control: ControlClient, metrics: ApiMetrics) -> None:
        self.control = control
        self.num_shards = control.num_shards
        self._metrics = metrics

    async def stats_each(self) -> list[dict[str, Any] | PSError]:
        got = await asyncio.gather(
            *(self._metrics.timed(s.shard_id, "stats", s.stats) for s in self.control.shards),
            return_exceptions=True,
        )
        for r in got:
            if isinstance(r, BaseException) and not isinstance(r, PSError):
                raise r
        # As JSON, as a replica's own (`ReplicaView`): what the metrics and ``/v1/model`` read.
        return [r if isinstance(r, PSError) else msgspec.to_builtins(r) for r in got]

    async def statuses(self) -> list[BoardEntry]:
        return await self._metrics.timed(0, "status", self.control.statuses)


async def all_stats(view: ClusterView) -> list[dict[str, Any]]:
    """Every shard's stats; the first shard's error raised as itself."""
    got = await view.stats_each()
    for r in got:
        if isinstance(r, PSError):
            raise r
    return [r for r in got if isinstance(r, dict)]
