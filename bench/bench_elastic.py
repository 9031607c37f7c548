"""Benchmark: what routing keys through slots costs in the steady state.

A cluster starts on the even slot map, which routes every key as
``shard_of(key, S)`` did before there were slots (`ps_core.slots`: it takes
that very path), so the even map is the baseline measured here. Once any slot
has moved, the map is no longer even and each key's shard is one gather more
(``owners[mix64(key) % slots]``), on the client (its split) and on the shard
(its ownership check). Both are measured in the same run, interleaved:

- **route**: a client's split of a batch of fresh keys by shard
  (`PSClient.route`), keys per second;
- **round trip**: a pull and a push of a batch through two shards in this
  process, each checking every key it is sent as a shard server does (no
  network: what differs is the routing alone), keys per second.

The moved map is the even map of 2 shards with one slot given to the other
shard (epoch 2).

- **moves during pushes**: a quarter of shard 0's slots move to shard 1
  (`move_slots`, steps of 256 slots) while a client pulls and pushes without
  pause: rows moved a second, each step's pause of its slots' keys, and the
  calls' latency before and during the moves (in one process: a step's copy
  holds the event loop, as it holds a shard's).

Grow and shrink while running and balancing by load are not built yet.

Run:
    .venv/bin/python bench/bench_elastic.py --quick   # 3 rounds, ~20 s
    .venv/bin/python bench/bench_elastic.py           # 9 rounds
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from common import bench_mode, bench_parser, print_result, progress_log

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.moves import move_slots
from ps_core.net.client import PSClient
from ps_core.net.transports import LocalTransport
from ps_core.shard import Shard, ShardSpec
from ps_core.slots import SlotMap
from ps_core.store.table_config import TableConfig

log = progress_log("bench_elastic")

SHARDS = 2
BATCH = 8192
"""Keys a call carries: a mini-batch of 256 events of ~30 features."""
TABLE = TableConfig("w", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})


def _maps() -> dict[str, SlotMap]:
    even = SlotMap.even(SHARDS)
    return {"even": even, "moved": even.moved({0: 1})}


def _route_keys_per_s(slot_map: SlotMap, batches: list[np.ndarray], seconds: float) -> float:
    client = PSClient([LocalTransport(Shard(ShardSpec(i, SHARDS))) for i in range(SHARDS)])
    client.slot_map = slot_map
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for keys in batches:
            client.route(keys)
            n += keys.size
    return n / (time.perf_counter() - t0)


async def _round_trip_keys_per_s(slot_map: SlotMap, batches: list[np.ndarray], seconds: float) -> float:
    shards = [Shard(ShardSpec(i, SHARDS), (TABLE,)) for i in range(SHARDS)]
    for s in shards:
        s.adopt_slot_map(slot_map)
    # No `routed_by`: each shard checks every key it is sent, as a shard server does.
    client = PSClient([LocalTransport(s) for s in shards])
    client.slot_map = slot_map
    grads = np.full((BATCH, 1), 0.01, dtype=np.float32)
    for keys in batches:  # every row exists: the steady state, not inserts
        await client.push("w", keys, grads[: keys.size])
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for keys in batches:
            routed = client.route(keys)
            await client.pull("w", routed)
            await client.push("w", routed, grads[: keys.size])
            n += keys.size
    return n / (time.perf_counter() - t0)


async def _moves_during_pushes(batches: list[np.ndarray], rows: int, slots: int) -> dict[str, Any]:
    """Two shards holding `rows` rows; a client pulls and pushes batches
    without pause while `slots` of shard 0's slots move to shard 1 (steps of
    `BATCH` slots, as `ctrps rebalance` runs them). Each call's latency
    before and during the moves, the moves' rows a second and each step's
    pause of its slots' keys."""
    shards = [Shard(ShardSpec(i, SHARDS), (TABLE,)) for i in range(SHARDS)]
    client, control = PSClient.local(shards), ControlClient.local(shards)
    client.slot_source = control.slot_map
    rng = np.random.default_rng(9)
    held = rng.integers(1, 2**64 - 1, size=rows, dtype=np.uint64)
    for start in range(0, rows, 100_000):
        part = held[start : start + 100_000]
        await client.push("w", part, np.full((part.size, 1), 0.01, dtype=np.float32))
    grads = np.full((BATCH, 1), 0.01, dtype=np.float32)
    latencies: dict[str, list[float]] = {"before": [], "during": []}
    phase = "before"
    stop = asyncio.Event()

    async def pushing() -> None:
        while not stop.is_set():
            for keys in batches:
                t0 = time.perf_counter()
                routed = client.route(keys)
                await client.pull("w", routed)
                await client.push("w", routed, grads[: keys.size])
                latencies[phase].append((time.perf_counter() - t0) * 1e3)
                await asyncio.sleep(0)

    task = asyncio.create_task(pushing())
    await asyncio.sleep(1.0)  # the latency before: a second of calls
    phase = "during"
    t0 = time.perf_counter()
    steps = await move_slots(control, SlotMap.even(SHARDS).slots_of(0)[:slots].tolist(), 1)
    seconds = time.perf_counter() - t0
    stop.set()
    await task
    moved = sum(s.rows for s in steps)

    def pct(name: str, q: float) -> float:
        return round(float(np.percentile(latencies[name], q)), 2)

    return {
        "rows": rows,
        "slots_moved": slots,
        "rows_moved": moved,
        "steps": len(steps),
        "move_seconds": round(seconds, 3),
        "rows_moved_per_s": round(moved / seconds),
        "step_pause_ms": {
            "max": round(max(s.paused_ms for s in steps), 2),
            "mean": round(float(np.mean([s.paused_ms for s in steps])), 2),
        },
        "call_p50_ms": {"before": pct("before", 50), "during": pct("during", 50)},
        "call_p99_ms": {"before": pct("before", 99), "during": pct("during", 99)},
        "calls": {k: len(v) for k, v in latencies.items()},
        "reroutes": client.reroutes,
    }


def _figures(runs: dict[str, list[float]]) -> dict[str, Any]:
    even, moved = runs["even"], runs["moved"]
    ratios = [m / e for e, m in zip(even, moved)]
    return {
        "keys_per_s": {name: round(statistics.median(v)) for name, v in runs.items()},
        "ratio_moved_vs_even": round(statistics.median(ratios), 3),
        "ratio_moved_vs_even_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Benchmark the steady-state cost of routing by slots: a map with a moved slot against the even map "
        "(which routes as shard_of did), measured in the same run.",
        "3 rounds of 1 s per case instead of 9 rounds of 2 s (~20 s)",
        seed=5,
        record=True,
    )
    args = parser.parse_args(argv)
    rounds, seconds = (3, 1.0) if args.quick else (9, 2.0)
    rng = np.random.default_rng(args.seed)
    pool = rng.integers(1, 2**64 - 1, size=1_000_000, dtype=np.uint64)
    # Ids drawn from a pool, so batches repeat keys across calls (the rows exist) and few within one.
    batches = [np.unique(rng.choice(pool, BATCH)) for _ in range(16)]
    maps = _maps()
    route: dict[str, list[float]] = {name: [] for name in maps}
    trip: dict[str, list[float]] = {name: [] for name in maps}
    for r in range(rounds):
        order = list(maps) if r % 2 == 0 else list(reversed(maps))  # interleaved: the load hits both alike
        for name in order:
            route[name].append(_route_keys_per_s(maps[name], batches, seconds))
            trip[name].append(asyncio.run(_round_trip_keys_per_s(maps[name], batches, seconds)))
        log(
            f"round {r + 1}: route even {route['even'][-1] / 1e6:.1f}M moved {route['moved'][-1] / 1e6:.1f}M keys/s; "
            f"round trip even {trip['even'][-1] / 1e6:.2f}M moved {trip['moved'][-1] / 1e6:.2f}M keys/s"
        )
    moving = asyncio.run(_moves_during_pushes(batches, 400_000 if args.quick else 2_000_000, 1024))
    log(
        f"moves: {moving['rows_moved']} rows of {moving['slots_moved']} slots in {moving['steps']} steps, "
        f"{moving['rows_moved_per_s'] / 1e6:.2f}M rows/s, step pause max {moving['step_pause_ms']['max']} ms; "
        f"call p99 {moving['call_p99_ms']['before']} ms before, {moving['call_p99_ms']['during']} ms during"
    )
    result: dict[str, Any] = {
        "mode": bench_mode(args.quick),
        "rounds": rounds,
        "shards": SHARDS,
        "slots": maps["even"].slots,
        "batch_keys_mean": round(float(np.mean([b.size for b in batches]))),
        "route": _figures(route),
        "round_trip": _figures(trip),
        "moves_during_pushes": moving,
    }
    log(
        f"moved/even: route {result['route']['ratio_moved_vs_even']}x "
        f"{result['route']['ratio_moved_vs_even_range']}, round trip {result['round_trip']['ratio_moved_vs_even']}x "
        f"{result['round_trip']['ratio_moved_vs_even_range']}"
    )
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
