"""Bounded waits keep a cancellation (`ps_core.waits`).

On Python 3.11 ``asyncio.wait_for`` returns its awaitable's result when a
cancel arrives as that awaitable completes: a watch looping around it then
never ends, and a worker stopping waits on it until its caller gives up (a
worker's lag watch did, once in a full run). These tests build that moment.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ps_core.waits import cancelled, within

ROOT = Path(__file__).resolve().parents[1]


async def _cancel_as_it_completes(bounded: Callable[[Awaitable[int], float], Awaitable[int]]) -> bool:
    """Loop on `bounded` waits; cancel the loop in the same turn as the
    awaited future completes. Whether the loop then ended."""
    loop = asyncio.get_running_loop()
    gates: list[asyncio.Future[int]] = []

    async def watch() -> None:
        for _ in range(50):  # about 50 s if every cancel is lost: bounded, so a failing test ends
            gates.append(loop.create_future())
            await bounded(gates[-1], 10)
            await asyncio.sleep(1.0)

    task = asyncio.create_task(watch())
    for _ in range(100):
        await asyncio.sleep(0)
        if gates:
            break
    gates[-1].set_result(1)
    await asyncio.sleep(0)  # the awaited future's callbacks run: the wait is about to return
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    if not done:
        task.cancel()  # the loop's sleep takes this one
        await asyncio.wait({task}, timeout=5.0)
    return bool(done)


async def test_a_loop_of_bounded_waits_ends_when_cancelled_as_a_wait_completes() -> None:
    assert await _cancel_as_it_completes(within)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancel from Python 3.12")
async def test_the_moment_built_is_the_one_asyncio_wait_for_loses() -> None:
    # The same loop around asyncio.wait_for runs on: the test above builds the race it guards against.
    assert not await _cancel_as_it_completes(asyncio.wait_for)


async def test_within_times_out_and_cancels_what_it_waited_for() -> None:
    waited = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await within(waited, 0.05)
    assert waited.cancelled()
    assert await within(asyncio.sleep(0, result=7), None) == 7


async def test_cancelled_raises_the_callers_cancellation_not_the_tasks() -> None:
    cleaning = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cleaning.set()
            await asyncio.sleep(0.2)  # cleans up first, as a renewing lease or a probe does
            raise

    rounds = 0

    async def caller() -> None:
        nonlocal rounds
        while rounds < 20:  # a caller that goes on after each helper task it stops (bounded: a test that fails ends)
            rounds += 1
            helper = asyncio.create_task(slow_to_stop())
            await asyncio.sleep(0)
            await cancelled(helper)

    task = asyncio.create_task(caller())
    await asyncio.wait_for(cleaning.wait(), 5.0)
    task.cancel()  # arrives while the caller waits for its helper to stop
    done, _ = await asyncio.wait({task}, timeout=10.0)
    assert done and task.cancelled() and rounds == 1, rounds


async def test_cancelled_raises_the_tasks_own_failure() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancelled(task)
    done: asyncio.Task[Any] = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancelled(done)  # a task already finished: nothing to raise


def test_no_module_waits_with_asyncio_wait_for() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("ps_core", "consumers", "app")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\basyncio\.wait_for\(|\bfrom asyncio import .*\bwait_for\b", line)
    ]
    assert not found, f"use ps_core.waits.within (asyncio.wait_for loses cancellations on 3.11): {found}"
