"""What the benchmarks that run roles share: a broker topic preloaded with
synthetic events, shard servers started and stopped as processes, in-process
shards, running workers and their rates, CPU time per role.

Benchmarks import it; it is not a benchmark.
"""

from __future__ import annotations

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
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from common import progress_log

from consumers.broker import EmbeddedBroker, create_topics, free_port
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

log = progress_log("bench")
"""One progress line on stderr."""

PARTITIONS = 4


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
