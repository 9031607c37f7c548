"""A worker's leases (`consumers.leases`) from a real coordinator, in process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from waiting import until

from consumers import leases as leases_module
from consumers.leases import CoordinatorRestarted, Leases
from consumers.reports import WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.errors import NoCoordinatorError
from ps_core.shard import Shard, ShardSpec


async def _once(op: Callable[[], Awaitable[Any]]) -> Any:
    return await op()


def _leases(coordinator: Coordinator | None) -> tuple[Leases, WorkerStats]:
    stats = WorkerStats()
    control = ControlClient.local([Shard(ShardSpec(0, 1))], coordinator)
    return Leases(control, "w-1", 10.0, stats, log_every_s=0.05), stats


async def test_discover_finds_the_coordinator_and_its_epoch_or_its_absence() -> None:
    coordinator = Coordinator()
    leases, _ = _leases(coordinator)
    await leases.discover(_once, needed=True)
    assert leases.leased and leases.epoch == coordinator.epoch and coordinator.active_leases == 0
    plain, _ = _leases(None)
    await plain.discover(_once, needed=False)
    assert not plain.leased and plain.epoch is None
    with pytest.raises(NoCoordinatorError, match="sync mode needs the coordinator's barrier"):
        await plain.discover(_once, needed=True)


async def test_a_lease_from_another_coordinator_is_released_and_rewinds() -> None:
    coordinator = Coordinator()
    leases, _ = _leases(coordinator)
    await leases.discover(_once, needed=False)
    lease = await leases.take()
    await leases.release(lease, {"clicks": {0: 5}})
    assert coordinator.offsets() == {"clicks": {0: 5}}
    leases.epoch = "an earlier coordinator's"
    with pytest.raises(CoordinatorRestarted) as raised:
        await leases.take()
    assert raised.value.epoch == coordinator.epoch and coordinator.active_leases == 0


async def test_a_cut_pausing_leases_is_waited_for_and_counted_as_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases_module, "LEASE_WAIT_S", 0.05)  # ask again quickly while the cut pauses
    coordinator = Coordinator()
    leases, stats = _leases(coordinator)
    async with coordinator.paused():
        granting = asyncio.create_task(leases.grant())
        await until(lambda: stats.waiting_for == leases_module.CUT, what="the wait for the cut")
        assert stats.outages == 1 and not granting.done()
    grant = await asyncio.wait_for(granting, 5)
    assert grant.epoch == coordinator.epoch and stats.outages == 1
    assert stats.waiting_for == "" and stats.outage_seconds > 0
