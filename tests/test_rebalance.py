"""``ctrps rebalance`` against ``ctrps shard`` processes: a shard drained
while a client pushes, every push applied once on the shard its key's slot
is on; slots moved to a shard and shown; its refusals in one line."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from commands import PROJECT, ctrps
from test_restore_consistent import LR, Shards, _declared, _no_tracebacks

from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.slots import SlotMap

pytestmark = [pytest.mark.slow, pytest.mark.process]

KEYS = np.random.default_rng(23).integers(1, 2**64 - 1, size=4000, dtype=np.uint64)


async def _rebalance(*args: str) -> Any:
    """``ctrps rebalance ARGS`` run to its end; its JSON answer (exit 0 asserted)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "rebalance",
        *args,
        cwd=PROJECT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    return orjson.loads(out)


async def test_a_shard_drained_while_a_client_pushes_loses_and_repeats_nothing(tmp_path: Path) -> None:
    shards = Shards(3, tmp_path / "exports", tmp_path)
    rng = np.random.default_rng(5)
    pushes = [rng.choice(KEYS, 500, replace=False) for _ in range(40)]
    reference = Shard(ShardSpec(0, 1), (LR,))  # the same pushes, in order, on one shard in this process
    async with shards.serving(restore=False, deadline_s=10) as (client, control):
        await _declared(control, shards)
        client.slot_source = control.slot_map

        drain_done = asyncio.Event()
        sent: list[np.ndarray] = []

        async def pushing() -> None:
            # Until the drain is done and a few pushes after it: whatever the
            # command's start-up takes, pushes meet the moves.
            after = 0
            while after < 5:
                keys = pushes[len(sent) % len(pushes)]
                grads = np.ones((keys.size, 1), dtype=np.float32)
                await client.push(LR.name, keys, grads)
                await PSClient.local([reference]).push(LR.name, keys, grads)
                sent.append(keys)
                after += drain_done.is_set()

        pusher = asyncio.create_task(pushing())
        drained = await _rebalance("--shard0", shards.urls[0], "--drain", "2")
        drain_done.set()
        async with asyncio.timeout(60):
            await pusher
        assert drained["slot_map"]["epoch"] > 1 and {s["source"] for s in drained["steps"]} == {2}
        assert sum(s["slots"] for s in drained["steps"]) == SlotMap.even(3).load()[2]
        shown = await _rebalance("--shard0", shards.urls[0], "--show")
        assert [s["slots"] for s in shown["shards"]] == [2049, 2049, 0] and not shown["even"]
        assert shown["epoch"] == drained["slot_map"]["epoch"]
        stats = await control.stats()
        assert [s.tables[LR.name].features for s in stats][2] == 0
        pushed = np.unique(np.concatenate(sent))
        assert sum(s.tables[LR.name].features for s in stats) == pushed.size  # each key on one shard
        want = await PSClient.local([reference]).pull(LR.name, pushed)
        np.testing.assert_array_equal(await client.pull(LR.name, pushed), want)  # every push applied once
        assert client.reroutes >= 1
    for i in range(3):
        _no_tracebacks(shards, i)
    moved = [line for line in shards.lines(0) if line.get("msg") == "slots moved"]
    assert len(moved) == len(drained["steps"]) and all(line["source"] == 2 for line in moved)


def test_rebalance_refuses_what_it_cannot_do_in_one_line() -> None:
    for args, line in [
        (("--move", "0-3"), "--move needs --to SHARD"),
        (("--move", "3-1", "--to", "1"), "is not a slot or a rising range"),
        (("--move", "x", "--to", "1"), "slots are numbers and ranges"),
        (("--show", "--to", "1"), "--to goes with --move"),
    ]:
        out = ctrps("rebalance", "--shard0", "http://127.0.0.1:9", *args)
        assert out.returncode == 2, out.stderr
        assert line in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
