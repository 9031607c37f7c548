"""What a worker's pipeline asks of its Kafka clients, without a broker: the
consumer's assignment, positions and commits, and the dead-letter queue's
sends. For tests of the pipeline's own logic; the Kafka side itself is
tested against the embedded broker."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from consumers.dlq import DeadLetter

__all__ = ["Consumer", "Letters"]


class Letters:
    """Dead letters sent, in order."""

    def __init__(self) -> None:
        self.sent: list[DeadLetter] = []

    async def send_all(self, letters: list[DeadLetter]) -> None:
        self.sent.extend(letters)


class Consumer:
    """The assignment `owned`, the commits made (none acknowledged while
    `hang` is set), the seeks and the high watermarks given."""

    def __init__(self, owned: set[TopicPartition], highwater: dict[TopicPartition, int] | None = None) -> None:
        self.owned = owned
        self.commits: list[dict[TopicPartition, int]] = []
        self.seeks: dict[TopicPartition, int] = {}
        self.highwaters = highwater or {}
        self.hang = False

    def assignment(self) -> set[TopicPartition]:
        return self.owned

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.hang:
            await asyncio.Event().wait()
        self.commits.append(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highwaters.get(tp)
