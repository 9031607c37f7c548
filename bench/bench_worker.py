"""Benchmark: worker training throughput against the raw consume limit, and
progressive log loss against the Bayes (ground-truth) log loss.

A topic on the embedded broker (or ``CTRPS_KAFKA_BOOTSTRAP``) is pre-loaded
with synthetic Criteo-like events (13 numeric, 26 categorical fields; each
carries its true click probability). Then, in one run:

(a) raw: an aiokafka consumer reads every record and decodes it with orjson —
    the limit a worker cannot beat;
(b) a worker (`consumers.worker.Worker`, LR with FTRL, one decode process)
    trains on the topic with in-process shards;
(c) the same worker with 2 shard servers (``ctrps shard`` processes), every
    call over HTTP (``PSClient.connect(urls, rpc=False)``, ``--no-rpc``:
    aiohttp at both ends);
(d) the same with fresh shard servers, pulls and pushes over their TCP RPC
    (`ps_core.net.rpc`, the default of ``ctrps worker``).

Rates are events / second from the worker's first assigned partition to its
last commit (group joining excluded). Ratios b/a, c/a and d/a are printed, and the
progressive log loss of (b) over the whole stream (each event predicted before
it is learnt from) next to the Bayes log loss of the true probabilities.

The full run repeats (a)-(d) in 3 rounds (``--rounds``) and reports medians
(ratios: the median of each round's ratio to its own (a)): on a shared 2-core
machine one run's rates move by about 10 %. ``--quick`` runs one round.

Run: ``python bench/bench_worker.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import uuid
from typing import Any

import numpy as np
import uvloop
from common import add_record_option, bench_mode, elapsed_s, print_result, progress_log
from running import PARTITIONS, local_clients, preload, raw_rate, start_shards, stop_shards, wait_healthy, worker_rate

from consumers.broker import EmbeddedBroker, create_topics
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.net.client import PSClient
from ps_core.synthetic import bayes_logloss

log = progress_log("bench_worker")
"""One progress line on stderr."""


async def main(args: argparse.Namespace) -> dict[str, Any]:
    n = args.events or (100_000 if args.quick else 500_000)
    window = 20_000
    if n % window:
        # The worker's windows close at `window` events (event time spans an
        # hour): a last partial window would wait for events that never come.
        raise SystemExit(f"--events must be a multiple of {window}, not {n}")
    external = os.environ.get("CTRPS_KAFKA_BOOTSTRAP")
    broker = None if external else EmbeddedBroker()
    if broker is not None:
        await broker.start()
    bootstrap = external or (broker.bootstrap if broker else "")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        await create_topics(bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
        log(f"broker {bootstrap}; preloading {n} events into {PARTITIONS} partitions")
        p_true, labels = await preload(bootstrap, topic, n, args.seed)

        brokers = {"broker": [broker.pid]} if broker is not None else {}
        rates: dict[str, list[float]] = {k: [] for k in "abcd"}
        cpus: dict[str, list[dict[str, float]]] = {k: [] for k in "bcd"}
        wb: Worker | None = None
        for rnd in range(args.rounds):
            # Every round measures all four, the baseline included, so that
            # each round's ratios compare runs under the same machine load.
            tag = f"round {rnd + 1}/{args.rounds}: " if args.rounds > 1 else ""
            log(f"{tag}(a) raw consume + orjson decode")
            a = await raw_rate(bootstrap, topic, n)
            rates["a"].append(a)
            log(f"(a) {a:,.0f} events/s")

            log(f"{tag}(b) worker, in-process shards")
            b, worker_b, cpu_b = await worker_rate(
                bootstrap, topic, n, *local_clients(), window, args.decode_processes, args.mini_batch, brokers
            )
            wb = wb or worker_b
            rates["b"].append(b)
            cpus["b"].append(cpu_b)
            log(f"(b) {b:,.0f} events/s  b/a = {b / a:.2f}")

            for label, rpc in (("c", False), ("d", True)):
                log(
                    f"{tag}({label}) worker, 2 shard servers, "
                    + ("pulls and pushes over TCP RPC" if rpc else "HTTP only")
                )
                started, urls = start_shards(2)
                procs += started
                await wait_healthy(urls)
                async with PSClient.connect(urls, rpc=rpc) as client, ControlClient.connect(urls) as control:
                    rate, _, cpu = await worker_rate(
                        bootstrap,
                        topic,
                        n,
                        client,
                        control,
                        window,
                        args.decode_processes,
                        args.mini_batch,
                        {**brokers, "shards": [p.pid for p in started]},
                    )
                stop_shards(started)
                rates[label].append(rate)
                cpus[label].append(cpu)
                log(f"({label}) {rate:,.0f} events/s  {label}/a = {rate / a:.2f}")
        assert wb is not None
        med = {k: float(np.median(v)) for k, v in rates.items()}
        ratio = {k: float(np.median(np.array(rates[k]) / np.array(rates["a"]))) for k in "bcd"}
        cpu_mean = {k: {role: float(np.mean([c[role] for c in v])) for role in v[0]} for k, v in cpus.items()}
        if args.rounds > 1:
            log(
                f"medians of {args.rounds} rounds: a {med['a']:,.0f}, b {med['b']:,.0f} (b/a {ratio['b']:.2f}), "
                f"c {med['c']:,.0f} (c/a {ratio['c']:.2f}), d {med['d']:,.0f} (d/a {ratio['d']:.2f}) events/s"
            )

        hist = wb.stats.history
        for r in hist:
            log(
                f"  window {r.window}: {r.events} events, decode {r.decode_s * 1e3:.0f} ms, decode wait {r.decode_wait_s * 1e3:.0f} ms, "
                f"train {r.train_s * 1e3:.0f} ms, total {r.seconds * 1e3:.0f} ms"
            )
        ev = np.array([r.metrics.events for r in hist], dtype=np.float64)
        ll = np.array([r.metrics.logloss for r in hist], dtype=np.float64)
        progressive = float((ev * ll).sum() / ev.sum())
        late = hist[len(hist) // 2 :]
        ev2 = np.array([r.metrics.events for r in late], dtype=np.float64)
        progressive_late = float((ev2 * np.array([r.metrics.logloss for r in late])).sum() / ev2.sum())
        bayes = float(bayes_logloss(p_true, labels))
        bayes_late = float(bayes_logloss(p_true[n // 2 :], labels[n // 2 :]))
        log(
            f"progressive logloss {progressive:.4f} vs Bayes {bayes:.4f} (ratio {progressive / bayes:.3f}); "
            f"second half {progressive_late:.4f} vs {bayes_late:.4f}"
        )
        return {
            "mode": bench_mode(args.quick),
            "events": n,
            "partitions": PARTITIONS,
            "window_events": window,
            "rounds": args.rounds,
            "raw_consume_decode_events_per_s": med["a"],
            "worker_inprocess_events_per_s": med["b"],
            "worker_http_events_per_s": med["c"],
            "worker_rpc_events_per_s": med["d"],
            "ratio_inprocess_vs_raw": ratio["b"],
            "ratio_http_vs_raw": ratio["c"],
            "ratio_rpc_vs_raw": ratio["d"],
            **{
                f"rounds_{name}_events_per_s": rates[k]
                for k, name in (("a", "raw"), ("b", "inprocess"), ("c", "http"), ("d", "rpc"))
            },
            "mini_batch": args.mini_batch,
            **{f"inprocess_cpu_{role}_us_per_event": us for role, us in cpu_mean["b"].items()},
            **{f"http_cpu_{role}_us_per_event": us for role, us in cpu_mean["c"].items()},
            **{f"rpc_cpu_{role}_us_per_event": us for role, us in cpu_mean["d"].items()},
            "progressive_logloss": progressive,
            "bayes_logloss": bayes,
            "ratio_logloss_vs_bayes": progressive / bayes,
            "progressive_logloss_second_half": progressive_late,
            "bayes_logloss_second_half": bayes_late,
            "ratio_logloss_vs_bayes_second_half": progressive_late / bayes_late,
            "last_window_auc": hist[-1].metrics.auc,
            "elapsed_s": elapsed_s(),
        }
    finally:
        stop_shards(procs)
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k events, one round (under a minute)")
    parser.add_argument("--rounds", type=int, help="rounds of (a)-(d); figures are medians (default 3, --quick 1)")
    parser.add_argument("--events", type=int, help="override the number of events")
    parser.add_argument("--seed", type=int, default=0)
    add_record_option(parser)
    parser.add_argument("--decode-processes", type=int, default=1, help="the worker's decode processes")
    parser.add_argument("--mini-batch", type=int, default=WorkerConfig.mini_batch, help="events per pull/push step")
    parsed = parser.parse_args()
    if parsed.rounds is None:
        parsed.rounds = 1 if parsed.quick else 3
    print_result(uvloop.run(main(parsed)), parsed)
