"""A worker's consuming pipeline (`consumers.pipeline`) on its own: the open
window's decoding, the queue of closed windows, replays, commits and one
window applied under a lease — with real shards, coordinator and training;
only the Kafka clients are stood in for (`consumer_side`)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaTimeoutError
from consumer_side import Consumer, Letters

from consumers.lag_watch import LagWatch
from consumers.leases import Leases
from consumers.pipeline import DECODE_CHUNK, AlsoTrained, Chunk, Pipeline
from consumers.registration import Registration
from consumers.reports import Reports, WindowReport, WorkerStats
from consumers.resume import Resumer
from consumers.training import AsyncTraining
from consumers.windows import Window, WindowBuilder
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

P0, P1 = TopicPartition("clicks", 0), TopicPartition("clicks", 1)


def _records(tp: TopicPartition, first: int, values: list[bytes | None]) -> list[ConsumerRecord]:  # type: ignore[type-arg]
    return [
        ConsumerRecord(tp.topic, tp.partition, first + i, 1_700_000_000_000, 0, None, v, None, -1, len(v or b""), ())
        for i, v in enumerate(values)
    ]


def _good(n: int, seed: int = 3) -> list[bytes | None]:
    return [orjson.dumps(e) for e in SyntheticStream(seed=seed).batch(n)]


def _pipeline(coordinator: Coordinator | None = None, **kw: float) -> tuple[Pipeline, ControlClient, WorkerStats]:
    stats = WorkerStats()
    control = ControlClient.local([Shard(ShardSpec(0, 1))], coordinator)
    resumer = Resumer(control, stats, {}, bootstrap="127.0.0.1:1", group="g", topic="clicks", policy="committed")
    pipeline = Pipeline(
        WindowBuilder(within_s=3600, max_events=100_000),
        max_message_bytes=1 << 20,
        commit_timeout_s=kw.get("commit_timeout_s", 5.0),
        stats=stats,
        reports=Reports(stats, LagWatch(0)),
        leases=Leases(control, "w", 10.0, stats),
        resumer=resumer,
        registration=Registration(control),
    )
    return pipeline, control, stats


async def test_records_decode_in_chunks_and_a_revoke_drops_only_its_partitions() -> None:
    pipeline, _, _ = _pipeline()
    model = LogisticRegression("m")
    many = [b"{}"] * (2 * DECODE_CHUNK + 5)
    pipeline.add({P0: _records(P0, 0, list(many)), P1: _records(P1, 0, [b"{}"] * 3)}, [model])
    assert [(tp, n) for tp, n, _ in pipeline.chunks] == [
        (("clicks", 0), DECODE_CHUNK),
        (("clicks", 0), DECODE_CHUNK),
        (("clicks", 0), 5),
        (("clicks", 1), 3),
    ]
    assert await pipeline.revoke({("clicks", 1)}) == 3
    window, chunks = pipeline.take()
    assert window.size == len(many) == sum(n for _, n, _ in chunks) and set(window.next_offsets) == {("clicks", 0)}
    assert not pipeline.chunks and not len(pipeline.builder)


async def test_windows_apply_in_order_and_a_failure_fails_every_window_behind_it() -> None:
    pipeline, _, _ = _pipeline()
    applied: list[int] = []
    gate = asyncio.Event()

    async def apply(window: Window, chunks: list[Chunk]) -> None:
        await gate.wait()
        applied.append(window.seq)
        if window.seq == 2:
            raise RuntimeError("window 2 failed")

    for i in range(3):
        pipeline.add({P0: _records(P0, i * 10, [b"{}"] * 10)}, [LogisticRegression("m")])
        pipeline.enqueue(apply)
    pipeline.reap()  # nothing applied yet: nothing raised, nothing dropped
    assert len(pipeline.applies) == 3
    gate.set()
    await asyncio.wait([t for t, _ in pipeline.applies])
    assert applied == [1, 2]  # window 3 awaited window 2, which failed
    with pytest.raises(RuntimeError, match="window 2 failed"):
        pipeline.reap()
    assert [w.seq for _, w in pipeline.applies] == [2, 3]


async def test_a_replay_seeks_the_owned_partitions_to_the_first_offsets_dropped() -> None:
    pipeline, _, _ = _pipeline()
    pipeline.consumer = Consumer({P0})  # partition 1 was revoked meanwhile
    never = asyncio.Event()

    async def apply(window: Window, chunks: list[Chunk]) -> None:
        await never.wait()

    model = LogisticRegression("m")
    pipeline.add({P0: _records(P0, 40, [b"{}"] * 5), P1: _records(P1, 7, [b"{}"] * 5)}, [model])
    pipeline.enqueue(apply)
    pipeline.add({P0: _records(P0, 45, [b"{}"] * 5)}, [model])  # the open window
    seq, moved = await pipeline.replay()
    assert (seq, moved) == (1, {0: 40}) and pipeline.consumer.seeks == {P0: 40}
    assert not pipeline.applies and not len(pipeline.builder) and not pipeline.chunks


async def test_a_commit_is_made_for_owned_partitions_and_one_never_acknowledged_is_an_outage() -> None:
    pipeline, _, stats = _pipeline(commit_timeout_s=0.05)
    consumer = pipeline.consumer = Consumer({P0})
    pipeline.add({P0: _records(P0, 0, [b"{}"] * 4), P1: _records(P1, 0, [b"{}"] * 2)}, [LogisticRegression("m")])
    window, _ = pipeline.take()
    consumer.hang = True
    with pytest.raises(KafkaTimeoutError, match="not acknowledged within 0.05 s"):
        await pipeline.commit(window)
    assert stats.failed_commits == 1 and stats.commits == 0 and not pipeline.committed
    consumer.hang = False
    assert await pipeline.commit(window) == {"clicks": {0: 4}}
    assert consumer.commits == [{P0: 4}] and pipeline.committed == {("clicks", 0): 4} and stats.commits == 1


async def test_a_window_applies_under_a_lease_that_carries_its_commit_and_is_reported() -> None:
    coordinator = Coordinator()
    pipeline, control, stats = _pipeline(coordinator)
    await pipeline.leases.discover(lambda op: op(), needed=True)
    consumer = pipeline.consumer = Consumer({P0}, highwater={P0: 30})
    pipeline.dlq = letters = Letters()  # type: ignore[assignment]
    shards = [Shard(ShardSpec(0, 1))]
    model = LogisticRegression("m")
    for t in model.tables():
        shards[0].declare(t)
    training = AsyncTraining(PSClient.local(shards), model, stats, 8, ramp=0)
    reports: list[WindowReport] = []

    async def hook(report: WindowReport) -> None:
        reports.append(report)
        raise RuntimeError("a status sink that fails")  # logged; training goes on

    pipeline.add({P0: _records(P0, 0, [*_good(19), b"{broken"])}, [model])
    window, chunks = pipeline.take()
    await pipeline.apply(window, chunks, [AlsoTrained(model, training, stats, hook)])
    assert stats.events_trained == 19 and [d.offset for d in letters.sent] == [19]
    assert consumer.commits == [{P0: 20}] and coordinator.offsets() == {"clicks": {0: 20}}
    assert coordinator.active_leases == 0 and coordinator.leases_granted == 2
    assert [(r.events, r.dlq, r.lag) for r in reports] == [(19, 1, 10)]
    assert stats.windows == 1 and stats.last is reports[0]
