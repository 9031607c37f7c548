"""Dead letters: messages that failed to decode or validate, kept with their
reason and source, never dropped silently.

A dead-letter record's value is the original message bytes; its headers say
why and where from::

    ctrps-reason            e.g. invalid_json, missing_label (see ps_core.model.events.REASONS)
    ctrps-detail            a human-readable explanation
    ctrps-source-topic      the topic it was read from
    ctrps-source-partition  its partition (decimal)
    ctrps-source-offset     its offset (decimal)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["DeadLetter", "DeadLetterQueue", "read_headers"]


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


def read_headers(headers: Any) -> dict[str, str]:
    """A dead-letter record's headers as a dict of strings."""
    return {k: v.decode("utf-8", "replace") for k, v in headers or ()}


class DeadLetterQueue:
    """Sends dead letters to the DLQ topic through a started aiokafka producer
    and counts them by reason. `send_all` returns once the broker acknowledged
    every record, so the worker may commit the source offsets after it."""

    def __init__(self, producer: Any, topic: str) -> None:
        self._producer = producer
        self.topic = topic
        self.counts: Counter[str] = Counter()
        """Dead letters sent, by reason."""

    async def send_all(self, letters: list[DeadLetter]) -> None:
        if not letters:
            return
        futures = [await self._producer.send(self.topic, value=d.value or b"", headers=d.headers()) for d in letters]
        await asyncio.gather(*futures)
        self.counts.update(d.reason for d in letters)
