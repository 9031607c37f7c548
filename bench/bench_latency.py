"""Benchmark: async training's events/s when the shards are far, with 1, 2,
4 or 8 mini-batches in flight (``ctrps worker --in-flight``).

Two shard server processes (``ctrps shard``, pulls and pushes over their
TCP RPC, as ``ctrps worker`` sends them by default) hold a logistic
regression. A worker's training (`consumers.training.AsyncTraining`, driven
without Kafka: the events are decoded once beforehand) trains windows of
synthetic events, in chunks as a window's decoding hands them over, with
mini-batches of 256 events (no ramp), reaching the shards:

- on the loopback, as they are;
- through a delay proxy per shard (`tests/delay_proxy.py`, in this process)
  adding 0 ms (what the proxy itself costs), 10 ms each way (20 ms round
  trip) and 100 ms each way (200 ms).

Per link and depth it reports events/s (whole windows, for at least
``--seconds`` each), the ratio to loopback with one in flight measured in
the same run (and, through the proxy, to the proxy at 0 ms with one in
flight: the delay's own cost, since the proxy's CPU is the worker's), the link's rounds (requests that set out on an idle link, per
mini-batch) and the staleness the shards counted of these pushes (mean and
the largest bucket used). Before the runs one pass over the events creates
every row, so no run pays for its inserts.

Run: ``python bench/bench_latency.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's code (and tests/), before any of it is imported

from running import start_shards, stop_shards, wait_healthy  # noqa: E402

from app.config.worker import WorkerSettings  # noqa: E402
from consumers.decode import decode_records  # noqa: E402
from consumers.worker import Worker, WorkerConfig  # noqa: E402
from ps_core.checkpoint.control import ControlClient  # noqa: E402
from ps_core.model.batch import EventBatch  # noqa: E402
from ps_core.model.models import LogisticRegression  # noqa: E402
from ps_core.net.client import PSClient  # noqa: E402
from ps_core.synthetic import SyntheticStream  # noqa: E402
from tests.delay_proxy import DelayProxy, through  # noqa: E402
from tests.training import window_of  # noqa: E402

log = progress_log("bench_latency")
"""One progress line on stderr."""

MINI_BATCH = 256
CHUNK = 2_000
"""Events per piece of a window (a decode chunk's size in a worker)."""


async def _rpc_ports(urls: list[str]) -> list[int]:
    """Each shard's RPC port, as its ``/healthz`` advertises it."""
    async with aiohttp.ClientSession() as s:
        ports = []
        for url in urls:
            async with s.get(url + "/healthz") as r:
                ports.append(int((await r.json())["rpc_port"]))
        return ports


async def _pieces(batch: EventBatch) -> AsyncIterator[EventBatch]:
    for start in range(0, batch.size, CHUNK):
        yield batch.slice(start, min(start + CHUNK, batch.size))


def _staleness(stats: list[Any]) -> tuple[dict[str, int], int, int]:
    """The model table's staleness buckets, sum and count over the shards."""
    buckets: dict[str, int] = {}
    total = count = 0
    for shard in stats:
        s = shard.tables["lat_w"].staleness
        for bound, k in s.buckets.items():
            buckets[bound] = buckets.get(bound, 0) + k
        total += s.sum
        count += s.count
    return buckets, total, count


async def _run(
    urls: list[str],
    ports: list[int],
    delay_ms: float | None,
    depth: int,
    windows: list[tuple[EventBatch, list[bytes | None]]],
    seconds: float,
    least: int = 1,
) -> dict[str, Any]:
    """Train whole windows (at least `least`) for at least `seconds`, cycling
    over them, at `depth` in flight, on the loopback (`delay_ms` None) or
    through proxies."""
    model = LogisticRegression("lat")
    wire = WorkerSettings(bootstrap="unused:9092", shards=("http://unused",)).wire()
    proxies = [] if delay_ms is None else [await DelayProxy("127.0.0.1", p, delay_ms / 1000).start() for p in ports]
    client = PSClient.connect(urls, wire=wire)
    if proxies:
        through(client, proxies)
    control = ControlClient.connect(urls)
    try:
        config = WorkerConfig(
            "unused:9092", mini_batch=MINI_BATCH, mini_batch_ramp=0, decode_processes=0, in_flight=depth
        )
        training = Worker(config, client, control, model).training
        for table in model.tables():  # as a worker does on starting (the first run creates them)
            await control.declare(table)
        before = _staleness(await control.stats())
        events = steps = 0
        t0 = time.perf_counter()
        i = 0
        while i < least or time.perf_counter() - t0 < seconds:
            batch, values = windows[i % len(windows)]
            await training.train(_pieces(batch), window_of(values))
            events += batch.size
            steps += -(-batch.size // MINI_BATCH)
            i += 1
        dt = time.perf_counter() - t0
        after = _staleness(await control.stats())
    finally:
        await client.close()
        await control.close()
        for p in proxies:
            await p.close()
    buckets = {b: after[0][b] - before[0].get(b, 0) for b in after[0]}
    count = after[2] - before[2]
    used = [b for b, k in buckets.items() if k]
    out: dict[str, Any] = {
        "events_per_s": events / dt,
        "events": events,
        "seconds": dt,
        "staleness_mean": (after[1] - before[1]) / count if count else 0.0,
        "staleness_max_bucket": used[-1] if used else "0",
    }
    if proxies:
        out["rounds_per_mini_batch"] = sum(p.rounds for p in proxies) / len(proxies) / steps
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    window_events = args.window_events
    n_windows = 2 if args.quick else 4
    depths = (1, 2, 4, 8)
    links: list[tuple[str, float | None, tuple[int, ...]]] = (
        [
            ("loopback", None, (1, 2, 4)),
            ("proxy_0ms", 0.0, (1,)),
            ("rtt_20ms", 10.0, depths),
            ("rtt_200ms", 100.0, (1, 8)),
        ]
        if args.quick
        else [
            ("loopback", None, depths),
            ("proxy_0ms", 0.0, (1, 4)),
            ("rtt_20ms", 10.0, depths),
            ("rtt_200ms", 100.0, depths),
        ]
    )
    seconds = args.seconds or (2.0 if args.quick else 6.0)
    log(f"{n_windows} windows of {window_events:,} synthetic events, decoded once")
    values: list[bytes | None] = [
        orjson.dumps(e) for e in SyntheticStream(seed=args.seed).batch(n_windows * window_events)
    ]
    windows = []
    for w in range(n_windows):
        part = values[w * window_events : (w + 1) * window_events]
        windows.append((decode_records(part, "lat", 1 << 20).batch, part))
    procs, urls = start_shards(2)
    runs: dict[str, dict[str, Any]] = {}
    try:
        await wait_healthy(urls)
        ports = await _rpc_ports(urls)
        warm = await _run(urls, ports, None, 1, windows, 0.0, least=len(windows))  # one pass: every row created
        log(f"warm-up pass: {warm['events_per_s']:,.0f} events/s")
        for name, delay, ds in links:
            for d in ds:
                got = await _run(urls, ports, delay, d, windows, seconds)
                runs[f"{name}_d{d}"] = got
                rounds = got.get("rounds_per_mini_batch")
                log(
                    f"{name} in-flight {d}: {got['events_per_s']:,.0f} events/s, staleness mean "
                    f"{got['staleness_mean']:.2f} (largest bucket {got['staleness_max_bucket']})"
                    + ("" if rounds is None else f", {rounds:.2f} rounds per mini-batch")
                )
    finally:
        stop_shards(procs)
    base = runs["loopback_d1"]["events_per_s"]
    proxied = runs["proxy_0ms_d1"]["events_per_s"]
    for k, r in runs.items():
        r["ratio_to_loopback_d1"] = r["events_per_s"] / base
        if not k.startswith("loopback"):  # the delay alone: the proxy's own cost is in both
            r["ratio_to_proxy_0ms_d1"] = r["events_per_s"] / proxied
    best20 = max((r["ratio_to_loopback_d1"], k) for k, r in runs.items() if k.startswith("rtt_20ms"))
    log(
        f"20 ms round trip: in-flight 1 at {runs['rtt_20ms_d1']['ratio_to_loopback_d1']:.2f}x loopback, "
        f"best {best20[1]} at {best20[0]:.2f}x (aim: >= 0.5x), "
        f"{runs[best20[1]]['ratio_to_proxy_0ms_d1']:.2f}x the proxy without delay; took {elapsed_s():.0f} s"
    )
    return {
        "mode": bench_mode(args.quick),
        "window_events": window_events,
        "mini_batch": MINI_BATCH,
        "seconds_per_run": seconds,
        "runs": runs,
        "rtt_20ms_d1_ratio": runs["rtt_20ms_d1"]["ratio_to_loopback_d1"],
        "rtt_20ms_best_ratio": best20[0],
        "rtt_20ms_best": best20[1],
        "rtt_20ms_best_ratio_to_proxy_0ms": runs[best20[1]]["ratio_to_proxy_0ms_d1"],
    }


if __name__ == "__main__":
    parser = bench_parser(__doc__ or "", "fewer depths, 2 s a run (about a minute)", seed=1, record=True)
    parser.add_argument(
        "--window-events",
        type=int,
        default=20_000,
        help="events per window (default 20000): each window's first pull and last pushes are not overlapped",
    )
    parser.add_argument("--seconds", type=float, help="least seconds of training per run (default 6, --quick 2)")
    parsed = parser.parse_args()
    print_result(uvloop.run(main(parsed)), parsed)
