"""Reading the dead-letter topic back: the newest dead letters, with why and
where from (`newest_dead_letters`, behind ``ctrps dlq``).

The read is bounded: from each partition, its newest `limit` records only
(a seek to the end minus `limit`, no consumer group, nothing committed),
then merged newest first by the time the worker wrote them. A filter by
reason applies to those records.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from .dlq import read_headers
from .kafka_security import KafkaSecurity

__all__ = ["ReadLetter", "ReadTimeoutError", "UnknownTopicError", "newest_dead_letters"]


class UnknownTopicError(Exception):
    """The dead-letter topic does not exist on the broker."""

    exit_code = 1


class ReadTimeoutError(Exception):
    """The broker did not hand over the records within the deadline."""

    exit_code = 1


@dataclass(frozen=True)
class ReadLetter:
    """One dead-letter record as read back."""

    written_ms: int
    """When the worker wrote it (the record's timestamp, ms since the epoch)."""
    partition: int
    """Its partition in the dead-letter topic."""
    offset: int
    """Its offset there."""
    reason: str
    detail: str
    source_topic: str
    source_partition: int | None
    source_offset: int | None
    value: bytes
    """The original message's bytes (their start, if `original_bytes` is set)."""
    original_bytes: int | None = None
    """The original message's size where the record keeps only its start
    (too large for one record); None when `value` is whole."""


def _int(raw: str | None) -> int | None:
    return int(raw) if raw is not None and raw.lstrip("-").isdigit() else None


async def newest_dead_letters(
    bootstrap: str,
    topic: str,
    limit: int,
    *,
    reason: str | None = None,
    security: KafkaSecurity = KafkaSecurity(),
    timeout_s: float = 20.0,
) -> list[ReadLetter]:
    """The newest `limit` dead letters of `topic` (of `reason`, if given,
    among each partition's newest `limit`), newest first."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000),
        **security.client_kwargs(),
    )
    await consumer.start()
    try:
        # topics() fetches the cluster's metadata; then the topic's partitions are known.
        partitions = consumer.partitions_for_topic(topic) if topic in await consumer.topics() else None
        if not partitions:
            raise UnknownTopicError(f"no topic {topic!r} on {bootstrap}: is it the dead-letter topic (--topic)?")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begin[tp], end[tp] - limit))
        want = {tp for tp in tps if end[tp] > max(begin[tp], end[tp] - limit)}
        letters: list[ReadLetter] = []
        deadline = time.monotonic() + timeout_s
        while want and time.monotonic() < deadline:
            batch = await consumer.getmany(*want, timeout_ms=500)
            for tp, records in batch.items():
                for r in records:
                    h = read_headers(r.headers)
                    letters.append(
                        ReadLetter(
                            written_ms=int(r.timestamp),
                            partition=tp.partition,
                            offset=r.offset,
                            reason=h.get("ctrps-reason", ""),
                            detail=h.get("ctrps-detail", ""),
                            source_topic=h.get("ctrps-source-topic", ""),
                            source_partition=_int(h.get("ctrps-source-partition")),
                            source_offset=_int(h.get("ctrps-source-offset")),
                            value=r.value or b"",
                            original_bytes=_int(h.get("ctrps-original-bytes")),
                        )
                    )
                    if r.offset + 1 >= end[tp]:
                        want.discard(tp)
            await asyncio.sleep(0)
        if want:
            raise ReadTimeoutError(f"the dead letters of {topic!r} were not all read within {timeout_s:g} s")
    finally:
        await consumer.stop()
    if reason is not None:
        letters = [d for d in letters if d.reason == reason]
    letters.sort(key=lambda d: (d.written_ms, d.partition, d.offset), reverse=True)
    return letters[:limit]
