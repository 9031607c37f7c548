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
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import orjson
import uvloop
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from common import bench_mode, elapsed_s, print_result, progress_log

from consumers.broker import EmbeddedBroker, create_topics, free_port
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream, bayes_logloss

PARTITIONS = 4


log = progress_log("bench_worker")
"""One progress line on stderr."""


async def preload(
    bootstrap: str, topic: str, n: int, seed: int, events_per_s: float = 1000.0
) -> tuple[np.ndarray, np.ndarray]:
    """Produce n synthetic events (`events_per_s` of event time); returns their p_true and labels."""
    stream = SyntheticStream(seed=seed, events_per_s=events_per_s)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    p_true: list[float] = []
    labels: list[int] = []
    try:
        sent = 0
        for events in stream.iter_batches(n, 10_000):
            futs = []
            for i, ev in enumerate(events):
                p_true.append(ev["p_true"])
                labels.append(ev["label"])
                futs.append(
                    await producer.send(
                        topic,
                        orjson.dumps(ev),
                        partition=(sent + i) % PARTITIONS,
                        timestamp_ms=int(ev["ts"] * 1000),
                    )
                )
            await asyncio.gather(*futs)
            sent += len(events)
            log(f"preloaded {sent}/{n}")
    finally:
        await producer.stop()
    return np.array(p_true), np.array(labels)


async def preloaded_topic(bootstrap: str, n: int, seed: int) -> str:
    """A new topic (and its dead-letter topic) holding `n` synthetic events.

    Event time runs fast (1M events/s), so a worker's windows close at its
    window-events, and the stream's last ones at its window-seconds of wall time."""
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
    log(f"broker {bootstrap}; preloading {n} events into {PARTITIONS} partitions")
    await preload(bootstrap, topic, n, seed, events_per_s=1e6)
    return topic


async def raw_rate(bootstrap: str, topic: str, n: int) -> float:
    """(a) consume + orjson decode, no group, no training."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_bytes=50 << 20)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        got = 0
        t0 = time.perf_counter()
        deadline = t0 + 300
        loads = orjson.loads
        while got < n and time.perf_counter() < deadline:
            for recs in (await c.getmany(timeout_ms=500, max_records=20_000)).values():
                for r in recs:
                    loads(r.value)
                got += len(recs)
        return got / (time.perf_counter() - t0)
    finally:
        await c.stop()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_by_role(worker: Worker, others: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of the worker's process, its decode processes and `others`."""
    pool = worker._pool
    decoders = list(pool._processes) if pool is not None and pool._processes else []
    roles = {"main": [os.getpid()], "decode": decoders, **others}
    return {role: sum(cpu_seconds(p) for p in pids) for role, pids in roles.items()}


def local_clients(num: int = 2) -> tuple[PSClient, ControlClient]:
    """Both planes' clients of `num` fresh in-process shards."""
    shards = [Shard(ShardSpec(i, num)) for i in range(num)]
    return PSClient.local(shards), ControlClient.local(shards)


def partitions_held(worker: Worker) -> int:
    """How many partitions the worker's group consumer holds now (0 before it joined)."""
    consumer = worker._consumer
    return len(consumer.assignment()) if consumer is not None else 0


class RunningWorkers:
    """Workers' `run` as tasks while an ``async with`` block runs; then they
    are stopped and awaited (60 s at most; a worker's failure is raised)."""

    def __init__(self, *workers: Worker) -> None:
        self.workers = workers
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> RunningWorkers:
        self._tasks = [asyncio.create_task(w.run(self._stop)) for w in self.workers]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)

    def trained(self) -> int:
        """Events the workers have trained or dead-lettered so far."""
        return sum(w.stats.events_trained + w.stats.dead_letters for w in self.workers)

    async def polls(
        self,
        n: int,
        what: str,
        *,
        timeout_s: float = 600.0,
        poll_s: float = 0.02,
        progress: Callable[[str], None] | None = None,
    ) -> AsyncIterator[None]:
        """One item every `poll_s` until the workers have trained (or
        dead-lettered) `n` events. A worker's failure is raised at once, and
        TimeoutError naming `what` after `timeout_s`; with `progress`, a line
        ``what: trained k/n`` every 2 s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last_progress = 0.0
        while self.trained() < n:
            for task in self._tasks:
                if task.done():
                    task.result()
            trained = sum(w.stats.events_trained for w in self.workers)
            if loop.time() > deadline:
                raise TimeoutError(f"{what}: trained {trained}/{n}")
            yield
            if progress is not None and time.perf_counter() - last_progress > 2:
                progress(f"  {what}: trained {trained}/{n}")
                last_progress = time.perf_counter()
            await asyncio.sleep(poll_s)  # poll interval


async def each_round(
    n: int,
    seed: int,
    rounds: int,
    variants: Sequence[str],
    run: Callable[[str, str, str], Awaitable[dict[str, Any]]],
    describe: Callable[[str], str],
    progress: Callable[[str], None],
) -> list[dict[str, dict[str, Any]]]:
    """`run(variant, bootstrap, topic)` of every variant in each of `rounds`,
    over one topic of `n` synthetic events on a fresh embedded broker: every
    round runs every variant, so each round's figures compare runs under the
    same machine load (the reports take medians). Each round's figures by
    variant; `describe(variant)` ends the progress line that starts a run."""
    broker = EmbeddedBroker()
    await broker.start()
    try:
        topic = await preloaded_topic(broker.bootstrap, n, seed)
        out: list[dict[str, dict[str, Any]]] = []
        for rnd in range(rounds):
            result: dict[str, dict[str, Any]] = {}
            for variant in variants:
                tag = f"round {rnd + 1}/{rounds}: " if rounds > 1 else ""
                progress(f"{tag}{describe(variant)}")
                result[variant] = await run(variant, broker.bootstrap, topic)
            out.append(result)
    finally:
        broker.stop()
    return out


async def worker_rate(
    bootstrap: str,
    topic: str,
    n: int,
    client: PSClient,
    control: ControlClient,
    window_events: int,
    decode_processes: int = 1,
    mini_batch: int = WorkerConfig.mini_batch,
    others: dict[str, list[int]] | None = None,
    also: tuple[str, ...] = (),
) -> tuple[float, Worker, dict[str, float]]:
    """(b)/(c) a worker trains the whole topic; events/s from assignment to
    last commit, and the CPU microseconds per event of each role (the worker's
    process, its decode processes, and `others`: broker, shard servers).
    `also`: models trained beside ``ctr`` on the same records (``--also-train``)."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(
        bootstrap,
        topic=topic,
        group=group,
        dlq_topic=topic + ".dlq",
        window_seconds=3600,
        window_events=window_events,
        decode_processes=decode_processes,
        mini_batch=mini_batch,
        mini_batch_ramp=0,  # the rate of a worker's months, not of its first 16k events
    )
    worker = Worker(config, client, control, LogisticRegression("ctr"), also=[LogisticRegression(m) for m in also])
    t_assigned = None
    async with RunningWorkers(worker) as running:
        async for _ in running.polls(n, "worker", progress=log):
            if t_assigned is None and partitions_held(worker):
                t_assigned = time.perf_counter()
                cpu0 = cpu_by_role(worker, others or {})
        t_done = time.perf_counter()
        cpu1 = cpu_by_role(worker, others or {})
    assert t_assigned is not None
    cpu_us = {role: (cpu1[role] - cpu0[role]) * 1e6 / n for role in cpu1}
    log("  CPU per event: " + ", ".join(f"{r} {us:.1f} us" for r, us in cpu_us.items()))
    return n / (t_done - t_assigned), worker, cpu_us


def start_shards(num: int, exports: str | None = None) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """`num` shard servers on free ports; with `exports`, shard 0 hosts the
    coordinator and exports there on demand only (else no exports at all)."""
    procs, urls = [], []
    ports = [free_port() for _ in range(num)]
    storage = (
        ["--no-exports"]
        if exports is None
        else [
            "--exports-dir",
            exports,
            "--export-interval",
            "0",
            "--shards",
            ",".join(f"http://127.0.0.1:{p}" for p in ports),
        ]
    )
    for i in range(num):
        port = ports[i]
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "app.cli",
                    "shard",
                    "--port",
                    str(port),
                    "--shard-id",
                    str(i),
                    "--num-shards",
                    str(num),
                    "--stats-interval",
                    "0",
                    *storage,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def stop_shards(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL whoever has not exited within 10 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


async def wait_healthy(urls: list[str]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        for url in urls:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(url)
                await asyncio.sleep(0.05)  # poll interval


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
    parser.add_argument("--decode-processes", type=int, default=1, help="the worker's decode processes")
    parser.add_argument("--mini-batch", type=int, default=WorkerConfig.mini_batch, help="events per pull/push step")
    parsed = parser.parse_args()
    if parsed.rounds is None:
        parsed.rounds = 1 if parsed.quick else 3
    print_result(uvloop.run(main(parsed)))
