"""Leases and cuts: a cut holds whole windows and their offsets."""

from __future__ import annotations

import asyncio
import time

import pytest
from waiting import until

from ps_core.checkpoint.coordinator import Coordinator
from ps_core.errors import CutInProgressError, LeaseError


async def test_a_cut_waits_for_active_leases_and_blocks_new_ones() -> None:
    coord = Coordinator(lease_ttl_s=10)
    lease = await coord.acquire("w1")
    events: list[str] = []

    async def snapshot(version: int, kind: str) -> str:
        events.append(f"snapshot {version} {kind}")
        return "copy"

    async def finish_window() -> None:
        await asyncio.sleep(0.2)  # the window's length, which lease_wait_s must show: the subject, not a wait-for
        events.append("released")
        assert await coord.release(lease.lease_id, {"clicks": {0: 40, 1: 38}})

    async def late_worker() -> None:
        # gather starts the cut first, and it closes leases before its first
        # await: this acquire arrives while the cut waits for w1.
        got = await coord.acquire("w2")
        events.append("w2 leased")
        await coord.release(got.lease_id, {"clicks": {0: 50}})

    t0 = time.monotonic()
    cut, _, _ = await asyncio.gather(coord.cut(snapshot), finish_window(), late_worker())
    assert events == ["released", "snapshot 1 base", "w2 leased"]
    assert cut.version == 1 and cut.kind == "base" and cut.parent is None and cut.snapshot == "copy"
    assert cut.offsets == {"clicks": {0: 40, 1: 38}}  # w2's window is not in this cut
    assert 0.15 <= cut.lease_wait_s <= cut.pause_s < time.monotonic() - t0 + 0.01
    assert coord.offsets() == {"clicks": {0: 50, 1: 38}}


async def test_an_expired_lease_stops_blocking_cuts() -> None:
    coord = Coordinator(lease_ttl_s=0.3)
    dead = await coord.acquire("dead-worker")

    async def snapshot(version: int, kind: str) -> None:
        return None

    cut = await asyncio.wait_for(coord.cut(snapshot), 5)
    assert cut.expired_leases == ["dead-worker"] and 0.25 <= cut.lease_wait_s < 2
    assert coord.leases_expired == 1 and coord.active_leases == 0
    # A late release is answered False, but its committed offsets still count.
    assert await coord.release(dead.lease_id, {"t": {3: 7}}) is False
    assert coord.offsets() == {"t": {3: 7}}
    with pytest.raises(LeaseError):
        await coord.release(99)


async def test_kinds_parents_and_a_failed_snapshot() -> None:
    coord = Coordinator(base_every=3)

    async def ok(version: int, kind: str) -> tuple[int, str]:
        return version, kind

    async def broken(version: int, kind: str) -> None:
        raise RuntimeError("a shard failed")

    cuts = [await coord.cut(ok) for _ in range(4)]
    assert [(c.version, c.kind, c.parent) for c in cuts] == [
        (1, "base", None),
        (2, "delta", 1),
        (3, "delta", 2),
        (4, "base", None),
    ]
    with pytest.raises(RuntimeError):
        await coord.cut(broken)
    # Leases reopen; version 5 is spent (shards that copied it may hold it,
    # their tables moved on past it): never handed out again, and the next
    # cut is a base even when a delta is asked for.
    lease = await asyncio.wait_for(coord.acquire("w"), 1)
    await coord.release(lease.lease_id)
    assert (coord.last_version, coord.cuts_spent) == (5, 1)
    again = await coord.cut(ok, kind="delta")
    assert (again.version, again.kind, again.parent) == (6, "base", None)
    delta = await coord.cut(ok)
    assert (delta.version, delta.kind, delta.parent) == (7, "delta", 6)


async def test_a_lease_wait_can_be_bounded() -> None:
    coord = Coordinator(lease_ttl_s=10)
    held = await coord.acquire("slow")
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def snapshot(version: int, kind: str) -> None:
        entered.set()
        await gate.wait()

    cut = asyncio.create_task(coord.cut(snapshot))
    await coord.release(held.lease_id)
    await asyncio.wait_for(entered.wait(), 5)  # the cut is now in its snapshot
    with pytest.raises(CutInProgressError):
        await coord.acquire("w", wait_s=0.05)
    gate.set()
    await cut
    assert (await coord.acquire("w", wait_s=0.05)).worker == "w"


async def test_a_lease_lives_its_ttl_unless_renewed_and_a_refusal_names_its_holder() -> None:
    coord = Coordinator(lease_ttl_s=60)
    live = await coord.acquire("live", ttl_s=1.0)
    dead = await coord.acquire("dead", ttl_s=1.0)
    assert live.ttl_s == dead.ttl_s == 1.0 and (await coord.acquire("cap", ttl_s=600)).ttl_s == 60
    await coord.release(coord.held()[-1].lease_id)

    async def snapshot(version: int, kind: str) -> None:
        return None

    async def renewing() -> None:  # the live worker, renewing every third of its ttl
        while coord.renew(live.lease_id):
            await asyncio.sleep(0.2)  # the renewal period (a third of the ttl): pacing, not a wait-for

    keep = asyncio.create_task(renewing())
    cut = asyncio.create_task(coord.cut(snapshot))
    await until(lambda: coord.cut_waits_for() != "no cut is in progress", 5, what="the cut to close leases")
    with pytest.raises(CutInProgressError) as refused:
        await coord.acquire("next", wait_s=0.1)
    said = refused.value.detail
    assert said.startswith("no lease within 0.1s: a cut waits for the lease worker live holds since "), said
    assert said.endswith("s unless renewed) and 1 other lease"), said
    # The dead lease ends at its ttl; the renewed one holds the cut until released.
    await until(lambda: [lease.worker for lease in coord.held()] == ["live"], 10, what="the dead lease dropped")
    assert not cut.done()
    with pytest.raises(CutInProgressError, match=r"the lease worker live holds since \d+s \(it ends in \d+s"):
        await coord.acquire("next", wait_s=0)
    keep.cancel()
    await coord.release(live.lease_id)
    done = await asyncio.wait_for(cut, 5)
    assert done.expired_leases == ["dead"]
    assert coord.renew(dead.lease_id) is False
    with pytest.raises(LeaseError):
        coord.renew(99)


def test_resuming_after_a_restore_continues_the_versions() -> None:
    coord = Coordinator(last_version=12, last_base=10, base_every=5, offsets={"t": {0: 5}})
    assert coord.next_kind() == "delta" and coord.offsets() == {"t": {0: 5}}
    assert Coordinator(last_version=14, last_base=10, base_every=5).next_kind() == "base"
