"""Checking the offsets a worker is told to resume from against the broker.

A restored model comes with the offsets its cut holds and the stream they
were read from (`ps_core.checkpoint.stream.StreamIdentity`). Before a worker seeks
there it asks the broker:

- its cluster id (``DescribeCluster``): another cluster — or the in-memory
  embedded broker after a restart, which gets a new id per start — holds
  other records at the same offsets;
- each partition's first offset and end (`partition_bounds`): an offset
  beyond the end (a topic recreated, a broker that lost its data) would fetch
  nothing forever on Tansu, and one before the start was deleted by retention.

What the worker does with offsets that fail these checks is its
``on_stale_offsets`` policy (`STALE_POLICIES`). The model's weights are kept
either way: events of the stream in front of the worker train on top of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CorruptRecordException, KafkaError, UnsupportedCodecError

from .kafka_security import KafkaSecurity

__all__ = [
    "STALE_POLICIES",
    "StaleOffsetsError",
    "StalePartition",
    "cluster_id",
    "partition_bounds",
    "bounds_reason",
]

STALE_POLICIES = ("committed", "earliest", "fail")
"""Values of ``on_stale_offsets``:

- ``committed`` (default): resume a partition at the group's own commit in
  the broker in front of the worker, or at its first offset where there is
  none (or it is out of range too);
- ``earliest``: at the partition's first offset;
- ``fail``: refuse to train (`StaleOffsetsError`, exit code 4)."""


class StaleOffsetsError(Exception):
    """The offsets to resume from do not belong to the broker's stream and
    the policy is ``fail``: an expected failure, one line, exit code 4."""

    exit_code = 4


@dataclass(frozen=True)
class StalePartition:
    """One partition whose resume offset failed a check."""

    partition: int
    offset: int
    """The offset the worker was told to resume from."""
    start: int
    """The partition's first offset in the broker."""
    end: int
    """The partition's end (next offset to be written)."""
    reason: str
    """``cluster``, ``group``, ``beyond_end`` or ``before_start``."""
    source: str
    """Where `offset` came from: ``coordinator`` (the restored cut) or ``group`` (the group's commit)."""
    resumed: int | None = None
    """Where the worker resumes instead (None under ``fail``)."""


def bounds_reason(offset: int, start: int, end: int) -> str | None:
    """``beyond_end`` / ``before_start`` when `offset` is outside ``[start, end]``."""
    if offset > end:
        return "beyond_end"
    if offset < start:
        return "before_start"
    return None


async def cluster_id(bootstrap: str, timeout_ms: int = 10_000, security: KafkaSecurity = KafkaSecurity()) -> str:
    """The cluster id the broker at `bootstrap` reports (``DescribeCluster``)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=timeout_ms, **security.client_kwargs())
    await admin.start()
    try:
        answer = await admin.describe_cluster()
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await admin.close()
    cid = answer.get("cluster_id") if isinstance(answer, dict) else None
    if not isinstance(cid, str) or not cid:
        raise KafkaError(f"the broker at {bootstrap} reported no cluster id")
    return cid


async def partition_bounds(
    bootstrap: str,
    partitions: Iterable[TopicPartition],
    timeout_s: float = 15.0,
    security: KafkaSecurity = KafkaSecurity(),
) -> dict[TopicPartition, tuple[int, int]]:
    """Each partition's first offset and end, as (start, end).

    The end is the high watermark of a fetch from the partition's first
    offset, not ``ListOffsets(latest)`` (`end_offsets`): Tansu 0.6 answers
    that with the last batch's base offset + 1, short of the end whenever a
    batch holds several records. A fetch's high watermark is right on Tansu
    and on Apache Kafka, and a fetch at the first offset is always in range.
    One short-lived consumer outside any group does the fetches.
    """
    tps = list(partitions)
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=64 << 10,
        **security.client_kwargs(),
    )
    await consumer.start()
    try:
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, starts[tp])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(consumer.highwater(tp) is None for tp in tps):
            if loop.time() > deadline:
                missing = sorted(tp.partition for tp in tps if consumer.highwater(tp) is None)
                raise KafkaError(f"no fetch answer for partitions {missing} within {timeout_s:g} s")
            try:
                await consumer.getmany(timeout_ms=100, max_records=1)
            except (CorruptRecordException, UnsupportedCodecError):
                # The fetch answered (its high watermark is known); a batch
                # that cannot be decoded is the worker's to report, not the
                # bounds check's.
                pass
        return {tp: (int(starts[tp]), int(consumer.highwater(tp))) for tp in tps}
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await consumer.stop()
