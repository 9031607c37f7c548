"""Riding out outages: waiting for a shard, the coordinator or the broker,
one log line every few seconds, until it is back or a deadline passes; and
the error for a record batch the consumer cannot decode.

An outage is an error retrying can cure (`is_outage`): a `PSError` marked
`retriable` (a shard unreachable past the client's deadline, a cut holding
leases, a cluster not ready to grant them), a retriable Kafka error, or a
connection error. `OutageWatch.wait` probes the dependency until it answers,
logging what it waits for and for how long; past its deadline it raises
`OutageDeadlineError` (exit code 3).

Before a dependency has answered once, its silence is a wrong address more
likely than an outage: `StartupWatch` waits for it under the shorter
start-up deadline and raises `StartupTimeoutError` (exit code 1).

`retrying` is the one retry loop of the Kafka side: a call tried again
after each failure its caller's wait allows (`retrying_kafka`: a few quick
attempts on a Kafka or socket error; `consumers.outage_watch`: outages
waited out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from ps_core.errors import PSError, ShardUnavailableError
from ps_core.waits import cancelled, within

from .kafka_security import KafkaSecurity

__all__ = [
    "OutageDeadlineError",
    "StartupTimeoutError",
    "UndecodableBatchError",
    "OutageWatch",
    "StartupWatch",
    "is_outage",
    "began",
    "describe",
    "failed_partition",
    "locate_bad_batch",
    "undecodable_batch",
    "retrying",
    "retrying_kafka",
]

log = logging.getLogger("ctrps.worker")

_T = TypeVar("_T")


class OutageDeadlineError(Exception):
    """A dependency stayed unreachable past the outage deadline: the worker
    gives up (exit code 3)."""

    exit_code = 3

    def __init__(self, what: str, waited_s: float, deadline_s: float) -> None:
        super().__init__(
            f"gave up waiting for {what}: unreachable for {waited_s:.0f}s "
            f"(outage deadline {deadline_s:.0f}s, --outage-deadline)"
        )
        self.what = what
        self.waited_s = waited_s


class StartupTimeoutError(Exception):
    """A dependency never answered within the start-up deadline: its address
    is wrong, or it is not running (exit code 1)."""

    exit_code = 1

    def __init__(self, what: str, waited_s: float, flag: str, absent: str = "never answered") -> None:
        super().__init__(f"{what} {absent}: {waited_s:.0f}s since start ({flag}); check the address")
        self.what = what
        self.waited_s = waited_s


class UndecodableBatchError(Exception):
    """A record batch the Kafka client cannot decode (a bad CRC, a codec it
    cannot read, a malformed batch). The worker stops before it: nothing at
    or after `offset` of the partition is committed (exit code 1)."""

    exit_code = 1

    def __init__(self, topic: str, partition: int, offset: int, exact: bool, reason: str) -> None:
        if partition < 0:  # the client's error named no partition, and none was found
            message = (
                f"a record batch of topic {topic} (partition not known) cannot be decoded ({reason}); "
                "nothing past the offsets already committed is committed"
            )
        else:
            where = f"at offset {offset}" if exact else f"at or after offset {offset}"
            message = (
                f"record batch of {topic}/{partition} {where} cannot be decoded ({reason}); "
                f"nothing past offset {offset} is committed"
            )
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.exact = exact
        self.reason = reason


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` is a failure that waiting can cure."""
    if isinstance(exc, PSError):
        return exc.retriable
    if isinstance(exc, KafkaError):
        return bool(getattr(exc, "retriable", False)) or type(exc).__name__ in (
            "KafkaConnectionError",
            "KafkaTimeoutError",
            "NodeNotReadyError",
        )
    return isinstance(exc, (OSError, asyncio.TimeoutError))


async def retrying(
    call: Callable[[], Awaitable[_T]], wait: Callable[[Exception, float], Awaitable[None]], *, attempts: int = 0
) -> _T:
    """`call()`, tried again after each failure once `wait(exc, since)`
    returns (`since`: when the failed attempt began); `wait` raises to give
    up. With `attempts` > 0, the last attempt's failure is raised as is."""
    tried = 1
    while True:
        since = time.monotonic()
        if attempts and tried >= attempts:
            return await call()
        try:
            return await call()
        except Exception as exc:
            await wait(exc, since)
        tried += 1


async def retrying_kafka(call: Callable[[], Awaitable[_T]], attempts: int = 5, pause_s: float = 1.0) -> _T:
    """`call()`, tried again on a Kafka or socket error, `attempts` times in
    all: a broker that has just come back (the group rejoins as soon as it
    answers) may refuse a first admin or fetch connection."""

    async def pause(exc: Exception, since: float) -> None:
        if not isinstance(exc, (KafkaError, OSError)):
            raise exc
        await asyncio.sleep(pause_s)

    return await retrying(call, pause, attempts=attempts)


def began(exc: BaseException, noticed: float) -> float:
    """When the outage `exc` began (`time.monotonic`): when the call that
    failed sent its first attempt, if it says (a shard that stopped
    answering is noticed only when the client's deadline has passed), else
    `noticed`."""
    since = getattr(exc, "since", None)
    return min(noticed, since) if isinstance(since, float) else noticed


def describe(exc: BaseException, bootstrap: str) -> str:
    """What an outage waits for, for the log line: a shard and its URL, the
    coordinator, or the broker at the bootstrap address."""
    if isinstance(exc, ShardUnavailableError):
        return f"shard {exc.shard_id} at {exc.url}"
    if isinstance(exc, PSError):
        return f"the shards' coordinator ({exc.code}: {exc.detail})"
    return f"the Kafka broker at {bootstrap}"


_TP = re.compile(r"TopicPartition\(topic='([^']*)', partition=(\d+)\)")


def failed_partition(exc: BaseException, consumer: Any) -> tuple[str, int] | None:
    """The partition whose fetched batch raised `exc` in the consumer.

    aiokafka names it in a CRC error's message; for other decode errors the
    fetched result that raised is found in the consumer's fetcher (a private
    structure: None where it is not found)."""
    m = _TP.search(str(exc))
    if m:
        return m.group(1), int(m.group(2))
    records = getattr(getattr(consumer, "_fetcher", None), "_records", None)
    if not isinstance(records, dict):
        return None
    for tp, result in records.items():
        parts = getattr(result, "_partition_records", None)
        it = getattr(parts, "_records_iterator", None)
        # A generator that raised is finished (no frame) but still held.
        if it is not None and getattr(it, "gi_frame", True) is None:
            return tp.topic, tp.partition
    return None


async def locate_bad_batch(
    bootstrap: str,
    topic: str,
    partition: int,
    start: int,
    timeout_s: float = 20.0,
    security: KafkaSecurity = KafkaSecurity(),
) -> int | None:
    """The offset of the first batch at or after `start` that the Kafka client
    cannot decode, read one record at a time by a consumer of its own (no
    group, nothing committed); None when it is not found within `timeout_s`.

    One record per read: the client then raises on the bad batch with its
    position just before it, not at the start of a larger fetch."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None, **security.client_kwargs()
    )
    tp = TopicPartition(topic, partition)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        await within(consumer.start(), timeout_s)
        consumer.assign([tp])
        consumer.seek(tp, start)
        while loop.time() < deadline:
            try:
                await consumer.getmany(tp, timeout_ms=200, max_records=1)
            except Exception as exc:  # a codec's own error is not a KafkaError
                if is_outage(exc):
                    await asyncio.sleep(0.2)
                    continue
                pos: int = await consumer.position(tp)
                return pos
        return None
    except (TimeoutError, KafkaError, OSError):
        return None
    finally:
        with contextlib.suppress(Exception):
            await within(consumer.stop(), 5)


async def undecodable_batch(
    exc: Exception,
    consumer: Any,
    committed: dict[tuple[str, int], int],
    topic: str,
    bootstrap: str,
    security: KafkaSecurity = KafkaSecurity(),
) -> UndecodableBatchError:
    """The error for a fetch of `consumer` (reading `topic`) that raised `exc`
    decoding a record batch: which partition, from which offset (located
    exactly by a reader of its own where it can be; else the consumer's
    position, else what `committed` says)."""
    found = failed_partition(exc, consumer)
    reason = f"{type(exc).__name__}: {exc}"
    if found is None:
        owned = sorted((tp.topic, tp.partition) for tp in consumer.assignment())
        topic, partition = owned[0] if len(owned) == 1 else (topic, -1)
    else:
        topic, partition = found
    if partition < 0:
        return UndecodableBatchError(topic, -1, -1, False, reason)
    tp = TopicPartition(topic, partition)
    start = committed.get((topic, partition), 0)
    with contextlib.suppress(Exception):
        start = await within(consumer.position(tp), 10)
    exact = await locate_bad_batch(bootstrap, topic, partition, start, security=security)
    return UndecodableBatchError(topic, partition, start if exact is None else exact, exact is not None, reason)


async def _answers(probe: Callable[[], Awaitable[object]]) -> bool:
    """Whether `probe()` returned; False when it failed as an outage (any
    other failure is raised)."""
    try:
        await probe()
        return True
    except Exception as exc:
        if not is_outage(exc):
            raise
        return False


class OutageWatch:
    """Waits out outages under one deadline policy.

    `deadline_s` bounds each outage (0: wait forever); while waiting, one
    line every `log_every_s` says what is awaited and for how long."""

    def __init__(
        self,
        deadline_s: float,
        log_every_s: float = 5.0,
        probe_every_s: float = 1.0,
        logger: logging.Logger = log,
    ) -> None:
        self.deadline_s = deadline_s
        self.log_every_s = log_every_s
        self.probe_every_s = probe_every_s
        self.log = logger

    def waiting_line(self, what: str, waited_s: float) -> None:
        """Log that `what` has been awaited for `waited_s`."""
        limit = f"giving up after {self.deadline_s:.0f}s" if self.deadline_s > 0 else "waiting without a deadline"
        self.log.warning(
            f"waiting for {what}: unreachable for {waited_s:.0f}s, {limit}; not training or committing",
            extra={"fields": {"waiting_for": what, "waited_s": round(waited_s, 1), "deadline_s": self.deadline_s}},
        )

    def check_deadline(self, what: str, since: float) -> None:
        """Raise `OutageDeadlineError` once an outage begun at `since` (monotonic) outlasts the deadline."""
        waited = time.monotonic() - since
        if self.deadline_s > 0 and waited >= self.deadline_s:
            raise self.gave_up(what, waited)

    def gave_up(self, what: str, waited_s: float) -> Exception:
        """The error raised once `what` was awaited past the deadline."""
        return OutageDeadlineError(what, waited_s, self.deadline_s)

    async def wait(self, what: str, probe: Callable[[], Awaitable[object]], since: float) -> float:
        """Probe until `probe()` returns (the dependency answers); returns the
        seconds waited since `since` (monotonic, when the outage was seen).

        A probe failure that `is_outage` keeps waiting; any other is raised.
        Past the deadline, `OutageDeadlineError`."""

        async def ticker() -> None:
            while True:
                self.waiting_line(what, time.monotonic() - since)
                await asyncio.sleep(self.log_every_s)

        async def probing() -> None:
            while not await _answers(probe):
                await asyncio.sleep(self.probe_every_s)

        tick = asyncio.create_task(ticker())
        try:
            if self.deadline_s > 0:
                left = max(0.0, self.deadline_s - (time.monotonic() - since))
                try:
                    await within(probing(), left)
                except TimeoutError:
                    raise self.gave_up(what, time.monotonic() - since) from None
            else:
                await probing()
        finally:
            await cancelled(tick)
        waited = time.monotonic() - since
        self.answered(what, waited)
        return waited

    def answered(self, what: str, waited_s: float) -> None:
        """Log that `what` answered after `waited_s`."""
        self.log.info(
            f"{what} is back after {waited_s:.0f}s: resuming",
            extra={"fields": {"resumed": what, "waited_s": round(waited_s, 1)}},
        )


class StartupWatch(OutageWatch):
    """Waits for a dependency that has not answered yet, at a role's start:
    one line every `log_every_s` naming it and its address, and past
    `deadline_s` (the role's `flag`) `StartupTimeoutError`. A dependency that
    answers at the first probe logs nothing."""

    def __init__(
        self,
        deadline_s: float,
        flag: str,
        logger: logging.Logger = log,
        log_every_s: float = 5.0,
        *,
        awaited: str = "answer",
        absent: str = "never answered",
    ) -> None:
        super().__init__(deadline_s, log_every_s, probe_every_s=0.5, logger=logger)
        self.flag = flag
        self.awaited = awaited
        """What the lines wait for `what` to do: ``answer``, ``exist``."""
        self.absent = absent
        """What the error says `what` did: ``never answered``, ``does not exist``."""

    async def first_answer(self, what: str, probe: Callable[[], Awaitable[object]]) -> None:
        """Return once `probe()` returns; waits (and logs) only when its first call fails as an outage."""
        since = time.monotonic()
        if not await _answers(probe):
            await self.wait(what, probe, since)

    def waiting_line(self, what: str, waited_s: float) -> None:
        self.log.warning(
            f"waiting for {what} to {self.awaited}: {waited_s:.0f}s so far, giving up after "
            f"{self.deadline_s:.0f}s ({self.flag})",
            extra={"fields": {"waiting_for": what, "waited_s": round(waited_s, 1), "deadline_s": self.deadline_s}},
        )

    def gave_up(self, what: str, waited_s: float) -> Exception:
        return StartupTimeoutError(what, waited_s, self.flag, self.absent)

    def answered(self, what: str, waited_s: float) -> None:
        self.log.info(
            f"{what}: waited {waited_s:.0f}s for it to {self.awaited}",
            extra={"fields": {"answered": what, "waited_s": round(waited_s, 1)}},
        )
