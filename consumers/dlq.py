"""Dead letters: messages that failed to decode or validate, kept with their
reason and source, never dropped silently.

A dead-letter record's value is the original message bytes; its headers say
why and where from::

    ctrps-reason            e.g. invalid_json, missing_label (see ps_core.model.events.REASONS)
    ctrps-detail            a human-readable explanation
    ctrps-source-topic      the topic it was read from
    ctrps-source-partition  its partition (decimal)
    ctrps-source-offset     its offset (decimal)
    ctrps-original-bytes    only on a truncated record: the original's size (decimal)

A record is at most the producer's request size (`MAX_RECORD_BYTES`, the
Kafka client's default): the broker may accept larger messages than that, so
a dead letter that would not fit keeps the start of its bytes (as many as
fit) and says how many there were, rather than failing its window.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import UnknownError
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from .producer import UNKNOWN_ERROR_BACKOFF_S, UNKNOWN_ERROR_RETRIES

__all__ = ["MAX_RECORD_BYTES", "DeadLetter", "DeadLetterQueue", "read_headers"]

log = logging.getLogger("ctrps.dlq")

MAX_RECORD_BYTES = 1 << 20
"""Largest dead-letter record (value, headers and the batch around it): the
Kafka client's default ``max_request_size``, which the worker's producer keeps."""


@dataclass(frozen=True)
class DeadLetter:
    """One rejected message."""

    value: bytes | None
    """The original bytes."""
    reason: str
    """Machine-readable reason."""
    detail: str
    """Explanation."""
    topic: str
    """Source topic."""
    partition: int
    """Source partition."""
    offset: int
    """Source offset."""

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            ("ctrps-reason", self.reason.encode()),
            ("ctrps-detail", self.detail.encode("utf-8", "replace")[:1000]),
            ("ctrps-source-topic", self.topic.encode()),
            ("ctrps-source-partition", str(self.partition).encode()),
            ("ctrps-source-offset", str(self.offset).encode()),
        ]

    def record(self, max_bytes: int = MAX_RECORD_BYTES) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The record's value and headers, the value cut to the first bytes
        that fit in `max_bytes` (then ``ctrps-original-bytes`` says its size)."""
        value, headers = self.value or b"", self.headers()
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(None, value, headers)
        if size <= max_bytes:
            return value, headers
        headers.append(("ctrps-original-bytes", str(len(value)).encode()))
        # The estimate is linear in the value's length but for its varint
        # length prefix (5 bytes at most): cut that much more.
        over = DefaultRecordBatchBuilder.estimate_size_in_bytes(None, value, headers) - max_bytes
        return value[: max(0, len(value) - over - 5)], headers


def read_headers(headers: Any) -> dict[str, str]:
    """A dead-letter record's headers as a dict of strings."""
    return {k: v.decode("utf-8", "replace") for k, v in headers or ()}


class DeadLetterQueue:
    """Sends dead letters to the DLQ topic through a started aiokafka producer
    and counts them by reason. `send_all` returns once the broker acknowledged
    every record, so the worker may commit the source offsets after it."""

    def __init__(self, producer: Any, topic: str, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self._producer = producer
        self.topic = topic
        self.max_record_bytes = max_record_bytes
        self.counts: Counter[str] = Counter()
        """Dead letters sent, by reason."""
        self.truncated = 0
        """Dead letters sent truncated (too large for one record)."""

    async def send_all(self, letters: list[DeadLetter]) -> None:
        """Send `letters`; returns once the broker acknowledged them all."""
        if not letters:
            return
        records = []
        for d in letters:
            value, headers = d.record(self.max_record_bytes)
            if len(value) < len(d.value or b""):
                self.truncated += 1
                log.warning(
                    f"dead letter of {d.topic}[{d.partition}]@{d.offset} ({d.reason}) truncated: "
                    f"{len(d.value or b'')} bytes, {len(value)} kept",
                    extra={"fields": {"reason": d.reason, "original_bytes": len(d.value or b""), "kept": len(value)}},
                )
            records.append((value, headers))
        for attempt in range(1, UNKNOWN_ERROR_RETRIES + 2):
            futures = [await self._producer.send(self.topic, value=v, headers=h) for v, h in records]
            try:
                await asyncio.gather(*futures)
                break
            except UnknownError as exc:
                # The embedded broker refuses once the first write to a
                # partition after a restart (see consumers.producer): all the
                # letters are sent again, at least once as every dead letter.
                if attempt > UNKNOWN_ERROR_RETRIES:
                    raise
                log.warning(
                    f"the broker refused dead letters with error -1: resending them ({attempt} of {UNKNOWN_ERROR_RETRIES})",
                    extra={"fields": {"topic": self.topic, "letters": len(records), "error": repr(exc)}},
                )
                await asyncio.gather(*futures, return_exceptions=True)
                await asyncio.sleep(UNKNOWN_ERROR_BACKOFF_S * attempt)
        self.counts.update(d.reason for d in letters)
