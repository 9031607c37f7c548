"""Streaming events through a real broker in tests: topics, producing,
committed offsets, workers (one, or a group's members) run as tasks, what the
shards applied, and the arguments of a ``ctrps shard`` process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumers.broker import create_topics
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.hashing import shard_of
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.models import Model
from ps_core.net.client import PSClient
from ps_core.shard import Shard

__all__ = [
    "KEY_BASE",
    "all_running",
    "applications",
    "assert_applied_once",
    "bias_shows",
    "brisk_worker_config",
    "committed",
    "confluent_produce",
    "consume_all",
    "group_of",
    "keyed_event",
    "new_topic",
    "produce",
    "running",
    "shard_args",
    "worker_config",
]

KEY_BASE = 10**12  # keyed_event(i) carries the pre-hashed key KEY_BASE + i: its shows count its applications


def keyed_event(i: int) -> bytes:
    """Event i, carrying its own key KEY_BASE + i (see `applications`)."""
    return orjson.dumps(
        {
            "id": f"e{i}",
            "ts": 1_764_681_600 + i * 0.01,
            "label": 1 if i % 4 == 0 else 0,
            "features": {"site": f"s{i % 13}"},
            "keys": [KEY_BASE + i],
        }
    )


async def new_topic(bootstrap: str, partitions: int, hex_digits: int = 8) -> tuple[str, str]:
    """A fresh click topic with `partitions` and its one-partition dead-letter
    topic, and a fresh group name: (topic, group)."""
    topic, group = f"clicks-{uuid.uuid4().hex[:hex_digits]}", f"g-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, {topic: partitions, topic + ".dlq": 1})
    return topic, group


async def produce(
    bootstrap: str, topic: str, values: Iterable[bytes], partitions: int, first: int = 0, rate: float | None = None
) -> None:
    """Send `values` as messages first, first+1, ... of the stream: message i
    to partition i % `partitions`; with `rate`, paced at that many a second.
    Returns once every one is acknowledged."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        futs = []
        for j, value in enumerate(values):
            i = first + j
            futs.append(await producer.send(topic, value, partition=i % partitions))
            if rate and i % 500 == 0:
                await asyncio.sleep(max(0.0, t0 + j / rate - loop.time()))  # pacing at `rate`, not a wait-for
        await asyncio.gather(*futs)
    finally:
        await producer.stop()


def confluent_produce(
    bootstrap: str,
    topic: str,
    values: Sequence[bytes],
    partitions: int = 1,
    timestamps_ms: Sequence[int] | None = None,
    config: dict[str, Any] | None = None,
) -> None:
    """Send `values` with an independent client (confluent-kafka, i.e.
    librdkafka), value i to partition i % `partitions` (with its timestamp
    from `timestamps_ms`, if given); `config` adds producer settings. Blocks
    until every one is delivered (run it in a thread)."""
    import confluent_kafka

    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all", **(config or {})}
    )
    failed: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    for i, value in enumerate(values):
        when = 0 if timestamps_ms is None else timestamps_ms[i]  # 0: the producer's clock
        producer.produce(topic, value=value, partition=i % partitions, on_delivery=delivered, timestamp=when)
        producer.poll(0)
    assert producer.flush(60) == 0, "confluent-kafka could not deliver everything"
    assert not failed, failed


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offset of each partition of `topic` (0 where none)."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return {p: (await c.committed(TopicPartition(topic, p))) or 0 for p in range(partitions)}
    finally:
        await c.stop()


async def consume_all(bootstrap: str, topic: str, n: int, timeout_s: float = 30.0) -> list[Any]:
    """At least `n` records of `topic` from its start, read within `timeout_s`
    by a consumer assigned every partition (no group: a group's join costs
    the broker's rebalance delay, seconds per call)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    records: list[Any] = []
    try:
        async with asyncio.timeout(timeout_s):
            while not (parts := consumer.partitions_for_topic(topic)):
                await consumer.topics()  # fetches the metadata that names the partitions
            consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
            await consumer.seek_to_beginning()
            while len(records) < n:
                batch = await consumer.getmany(timeout_ms=500)
                for recs in batch.values():
                    records.extend(recs)
    finally:
        await consumer.stop()
    return records


@asynccontextmanager
async def running(worker: Worker, stop_timeout_s: float = 60) -> AsyncIterator[asyncio.Task[Any]]:
    """`worker.run` as a task named "worker" while the block runs; then the
    worker is stopped and awaited (its failure, if any, is raised)."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop), name="worker")
    try:
        yield task
    finally:
        stop.set()
        await _stopped_within([task], stop_timeout_s)


@asynccontextmanager
async def all_running(workers: list[Worker], stop_timeout_s: float = 60) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Every worker's `run` as a task while the block runs; then all are
    stopped and awaited together (a failure, if any, is raised)."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        yield tasks
    finally:
        stop.set()
        await _stopped_within(tasks, stop_timeout_s)


async def _stopped_within(tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
    """Await the stopped workers' tasks (a failure, if any, is raised). One
    still running after `timeout_s` fails the test with where every task of
    the loop was waiting, then is cancelled and awaited, so that it closes
    its clients before the next test."""
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        where = "\n".join(_stack_of(t) for t in asyncio.all_tasks() if not t.done())
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=10)
        raise AssertionError(f"{len(pending)} worker(s) still running {timeout_s}s after stop; tasks:\n{where}")
    await asyncio.gather(*tasks)


def _stack_of(task: asyncio.Task[Any]) -> str:
    """Where a suspended task waits: its coroutine's chain of awaits."""
    lines, coro = [], task.get_coro()
    while coro is not None and len(lines) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return f"task {task.get_name()}:\n" + "\n".join(lines)


def group_of(config: WorkerConfig, shards: list[Shard], model: Model, members: int = 2) -> list[Worker]:
    """`members` workers of one group (one `config`) training `model` on the
    same in-process shards, each through its own clients."""
    return [Worker(config, PSClient.local(shards), ControlClient.local(shards), model) for _ in range(members)]


def applications(shards: list[Shard], lo: int, hi: int, table_name: str = "m_w") -> np.ndarray:
    """How many times each keyed event lo..hi-1 was applied (shows of its own key)."""
    keys = np.arange(KEY_BASE + lo, KEY_BASE + hi, dtype=np.uint64)
    out = np.zeros(hi - lo, dtype=np.int64)
    owner = shard_of(keys, len(shards))
    for i, shard in enumerate(shards):
        table = shard.tables.get(table_name)
        if table is None:
            continue
        mine = np.flatnonzero(owner == i)
        rows = table.index.lookup(keys[mine])
        present = rows >= 0
        out[mine[present]] = table.shows[rows[present]]
    return out


def assert_applied_once(shards: list[Shard], workers: list[Worker], n: int) -> None:
    """Keyed events 0..n-1 were each applied once, and the workers trained n events."""
    applied = applications(shards, 0, n)
    assert (applied == 1).all(), (
        f"missing {np.flatnonzero(applied == 0)[:10]}, twice {np.flatnonzero(applied > 1)[:10]}"
    )
    assert sum(w.stats.events_trained for w in workers) == n


def bias_shows(shards: list[Shard], namespace: str = "m") -> int:
    """Events applied in all, replays included: every event's bias id gets one
    show per application (docs/architecture.md, "Applied-event count")."""
    bias = np.array([FeatureHasher(namespace).bias_key], dtype=np.uint64)
    # The shard its slot is on (ps_core.slots): slots may have moved.
    table = shards[int(shards[0].slot_map.owner_of(bias)[0])].tables.get(f"{namespace}_w")
    if table is None:
        return 0
    row = int(table.index.lookup(bias)[0])
    return int(table.shows[row]) if row >= 0 else 0


def shard_args(i: int, ports: list[int], exports: Path, *extra: str) -> list[str]:
    """The arguments of ``ctrps shard`` for shard `i` of a cluster on loopback
    `ports`, exporting to `exports` on demand only (model "m", no stats
    lines), then `extra`."""
    return [
        "shard",
        "--port", str(ports[i]), "--shard-id", str(i), "--num-shards", str(len(ports)),
        "--shards", ",".join(f"http://127.0.0.1:{p}" for p in ports),
        "--exports-dir", str(exports), "--export-interval", "0", "--model-name", "m", "--stats-interval", "0",
        *extra,
    ]  # fmt: skip


def worker_config(
    bootstrap: str, topic: str, group: str, window_events: int, window_seconds: float = 3600, **kw: Any
) -> WorkerConfig:
    """A worker of `group` on `topic` that dead-letters to its ".dlq" topic and
    decodes on its event loop (no decode processes); `kw` sets the rest.

    Its group session lasts 6 s (heartbeats every half second), not 10: the
    embedded broker holds each join of a group for half the session, and
    it numbers a new group's first generation 0, which the Kafka client
    does not leave on stopping, so the next member of that group waits for
    the session to run out."""
    kw.setdefault("session_timeout_ms", 6000)
    kw.setdefault("heartbeat_interval_ms", 500)
    return WorkerConfig(
        bootstrap,
        topic=topic,
        group=group,
        dlq_topic=topic + ".dlq",
        window_seconds=window_seconds,
        window_events=window_events,
        decode_processes=0,
        **kw,
    )


def brisk_worker_config(
    bootstrap: str, topic: str, group: str, window_events: int, mini_batch: int, **kw: Any
) -> WorkerConfig:
    """A worker that notices within a second or so: half-second windows, quick
    group heartbeats, no decode processes; `kw` sets the rest."""
    return WorkerConfig(
        bootstrap,
        topic=topic,
        group=group,
        window_seconds=0.5,
        window_events=window_events,
        mini_batch=mini_batch,
        decode_processes=0,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        **kw,
    )
