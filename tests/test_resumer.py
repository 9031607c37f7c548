"""Where a worker's partitions resume (`consumers.resume.Resumer`): what it
does with stale offsets and with commits the shards' state lacks, on its own
(the checks against a real broker are in test_stale_offsets.py and
test_restore_gaps.py)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from consumer_side import Consumer

from consumers.broker import free_port
from consumers.reports import WorkerStats
from consumers.resume import Resumer, StaleOffsetsError, StalePartition, Uncovered, partition_bounds
from ps_core.checkpoint.control import ControlClient, ResumePoint
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.shard import Shard, ShardSpec

TPS = [TopicPartition("clicks", 0), TopicPartition("clicks", 1)]


def _resumer(policy: str) -> tuple[Resumer, WorkerStats]:
    stats = WorkerStats()
    control = ControlClient.local([Shard(ShardSpec(0, 1))])
    committed = {("clicks", 0): 90, ("clicks", 1): 40}
    resumer = Resumer(control, stats, committed, bootstrap="127.0.0.1:1", group="g", topic="clicks", policy=policy)
    resumer.cluster_id = "new-cluster"
    return resumer, stats


def _point() -> ResumePoint:
    return ResumePoint({"clicks": {0: 500}}, StreamIdentity("old-cluster", "g", ("clicks",)), restored=3)


async def test_stale_offsets_are_refused_under_fail_naming_both_clusters() -> None:
    resumer, stats = _resumer("fail")
    stale = [StalePartition(0, 500, 0, 100, "cluster", "coordinator")]
    with pytest.raises(StaleOffsetsError) as refused:
        await resumer.stale(None, stale, _point(), TPS)
    line = str(refused.value)
    assert "Kafka cluster old-cluster, this broker is new-cluster" in line and "0:500[0,100)" in line
    assert stats.stale_offsets == {("cluster", "fail"): 1}


async def test_stale_offsets_resume_at_the_first_offset_under_earliest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctrps.worker")
    resumer, stats = _resumer("earliest")
    stale = [StalePartition(0, 500, 7, 100, "beyond_end", "coordinator")]
    assert await resumer.stale(Consumer(set(TPS)), stale, _point(), TPS) == {TPS[0]: 7}
    # The old commit belongs to another stream: forgotten, partition 1's kept.
    assert resumer.committed == {("clicks", 1): 40}
    assert stats.stale_offsets == {("beyond_end", "earliest"): 1}
    (line,) = [r for r in caplog.records if r.message.startswith("stale offsets not applied")]
    assert line.fields["partitions"] == "0:500[7,100)->7"  # type: ignore[attr-defined]


async def test_commits_the_shards_lack_are_replayed_or_refused_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctrps.worker")
    resumer, stats = _resumer("committed")
    replayed = Uncovered(1, 10, 40, 0, "replayed")
    resumer.report_gaps([replayed], _point())
    assert stats.stale_offsets == {("uncovered", "replayed"): 1}
    assert [r.fields["events"] for r in caplog.records] == [30]  # type: ignore[attr-defined]
    with pytest.raises(StaleOffsetsError):
        resumer.report_gaps([replayed, Uncovered(0, 0, 90, 20, "refused")], _point())
    assert stats.stale_offsets == {("uncovered", "replayed"): 1, ("uncovered", "refused"): 1}


async def test_partition_bounds_with_the_broker_gone_leaves_no_client_open() -> None:
    # A worker asks for bounds again every second of an outage: a consumer
    # whose start failed must be closed, not left to the collector (which
    # logs "Unclosed AIOKafkaConsumer" at some later line, once per attempt).
    loop = asyncio.get_running_loop()
    unclosed: list[str] = []
    default = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unclosed.append(str(context.get("message"))))
    try:
        with pytest.raises(KafkaError):  # nothing listens there
            await partition_bounds(f"127.0.0.1:{free_port()}", [TopicPartition("clicks", 0)])
        gc.collect()
    finally:
        loop.set_exception_handler(default)
    assert not [m for m in unclosed if "Unclosed AIOKafkaConsumer" in m]
