"""Sending events to Kafka in batches (the producer side of the event format:
docs/architecture.md, "Events and feature ids").

`produce` encodes each event with orjson (one event per message value) and
spreads events round-robin over the topic's partitions. Each chunk of
`batch_size` events is split by partition into aiokafka record batches
(``create_batch`` / ``send_batch``) rather than one ``send`` per event: against
the embedded broker that is about twice as fast (measured ~165-180k events/s
against ~80-90k/s for per-event ``send`` with gathered futures, 100k events of
~640 B on 4 partitions) because the per-record work is one ``append`` instead of
a coroutine, a future and an accumulator lookup.

The Kafka timestamp of a record is the event's ``ts`` (CreateTime, in ms) when
the event has one, so workers window by event time; otherwise the send time.

Items of `events` that are `FormatError`s (rows a parser rejected) or cannot be
encoded are skipped and counted by reason in the report, never sent.
The producer is plain (not idempotent nor transactional: the embedded broker
supports neither), so a retried request may duplicate records: at-least-once.

Only acknowledged events are counted. A broker that stops acknowledging (dead,
hung, unreachable) is noticed within `delivery_timeout_s`: the sends still
waiting fail and `produce` raises `DeliveryTimeout` with what was acknowledged;
any other refusal of the broker raises `ProduceError`. A chunk refused with
error -1 (`UnknownError`) is first resent, a bounded number of times: the
embedded broker answers so once per partition written to before its topic
existed, as a producer resending across a broker restart does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownError

from .formats import FormatError
from .kafka_security import KafkaSecurity

__all__ = ["produce", "ProduceReport", "EventSource", "ProduceError", "DeliveryTimeout", "COMPRESSIONS"]

COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
"""The record-batch codecs `produce` can use (snappy, lz4 and zstd through
aiokafka's extras, i.e. cramjam)."""

Item = dict[str, Any] | FormatError
EventSource = Iterable[Item] | AsyncIterable[Item]
"""What `produce` sends: events (dicts) and, in their place, rows a parser rejected."""

log = logging.getLogger("ctrps.produce")

_MAX_EXAMPLES = 5
UNKNOWN_ERROR_RETRIES = 5
"""Times a send refused with error -1 is resent (the embedded broker's once-per-partition refusal)."""
UNKNOWN_ERROR_BACKOFF_S = 0.2  # times the attempt: 3 s in all, past the broker role's repair
_MAX_BATCH_BYTES = 512 * 1024  # under brokers' default 1 MiB message.max.bytes


@dataclass
class ProduceReport:
    """What `produce` did. `sent` counts events acknowledged by the broker."""

    topic: str
    sent: int = 0
    partitions: dict[int, int] = field(default_factory=dict)
    """Events acknowledged per partition."""
    bytes: int = 0
    """Encoded message bytes sent (values only)."""
    elapsed_s: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows not sent, by reason (a `FormatError.reason`, or ``not_serializable``)."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' messages."""

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    @property
    def events_per_s(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def skip(self, reason: str, message: str) -> None:
        """Count one skipped row."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skipped_examples) < _MAX_EXAMPLES:
            self.skipped_examples.append(message)

    def as_fields(self) -> dict[str, Any]:
        """The report as flat fields for a log line."""
        return {
            "topic": self.topic,
            "sent": self.sent,
            "skipped": self.skipped_total,
            "skipped_by_reason": ",".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "-",
            "partitions": ",".join(f"{p}={n}" for p, n in sorted(self.partitions.items())),
            "bytes": self.bytes,
            "elapsed_s": round(self.elapsed_s, 3),
            "events_per_s": round(self.events_per_s),
        }


class ProduceError(Exception):
    """The broker refused or failed a send; `report` holds what was acknowledged.

    An expected failure: ``ctrps produce`` reports it as one line and exits
    with `exit_code`."""

    exit_code = 1

    def __init__(self, message: str, report: ProduceReport) -> None:
        super().__init__(message)
        self.report = report


class DeliveryTimeout(ProduceError):
    """The broker acknowledged nothing for the delivery timeout: it is dead,
    hung or unreachable, and the producer gave up (exit code 3, as every role
    that gives up after an outage)."""

    exit_code = 3


@dataclass
class _Sending:
    """A chunk handed to Kafka and not yet acknowledged: kept until it is, so
    that it can be resent."""

    done: asyncio.Future[Any]
    counts: dict[int, int]
    """Events per partition."""
    values: list[bytes]
    stamps: list[int | None]
    first: int
    """The chunk's first event's index in the stream (its partition is first % partitions)."""
    attempts: int = 0


def _chunks(events: Iterable[Item], size: int) -> Iterator[list[Item]]:
    it = iter(events)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


async def _achunks(events: AsyncIterable[Item], size: int) -> AsyncIterator[list[Item]]:
    chunk: list[Item] = []
    async for item in events:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


async def _as_async(chunks: Iterator[list[Item]]) -> AsyncIterator[list[Item]]:
    for chunk in chunks:
        yield chunk


def _encode(chunk: list[Item], report: ProduceReport) -> tuple[list[bytes], list[int | None]]:
    """Values and timestamps (ms) of the chunk's events; rejects are counted and dropped."""
    values: list[bytes] = []
    stamps: list[int | None] = []
    for item in chunk:
        if isinstance(item, FormatError):
            report.skip(item.reason, str(item))
            continue
        if not isinstance(item, dict):
            report.skip("not_an_object", f"not an event dict: {type(item).__name__}")
            continue
        try:
            values.append(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY))
        except TypeError as exc:  # orjson.JSONEncodeError
            report.skip("not_serializable", f"event {item.get('id')!r}: {exc}")
            continue
        ts = item.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool) and 0 <= ts < 1e13:
            stamps.append(int(ts * 1000))
        else:
            stamps.append(None)
    return values, stamps


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _failure(
    exc: BaseException, report: ProduceReport, bootstrap: str, topic: str, delivery_timeout_s: float
) -> ProduceError:
    """The `ProduceError` for a failed send: a timeout or a connection-level
    (retriable) error means the broker stopped answering."""
    if isinstance(exc, (asyncio.TimeoutError, KafkaTimeoutError)) or getattr(exc, "retriable", False):
        return DeliveryTimeout(
            f"the broker at {bootstrap} acknowledged no send for {delivery_timeout_s:g} s: "
            f"gave up with {report.sent} events acknowledged ({type(exc).__name__}: {exc})",
            report,
        )
    return ProduceError(
        f"the broker at {bootstrap} refused a send to {topic!r}: {type(exc).__name__}: {exc} "
        f"({report.sent} events acknowledged)",
        report,
    )


def _check_arguments(
    batch_size: int, max_in_flight: int, rate: float | None, delivery_timeout_s: float, compression: str
) -> None:
    """`ValueError` for an argument of `produce` it cannot use."""
    if batch_size < 1 or max_in_flight < 1:
        raise ValueError("batch_size and max_in_flight must be >= 1")
    if rate is not None and not rate > 0:
        raise ValueError("rate must be > 0 events/s")
    if not 0 < delivery_timeout_s < float("inf"):
        raise ValueError("delivery_timeout_s must be a positive number of seconds")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")


def _client(bootstrap: str, delivery_timeout_s: float, compression: str, security: KafkaSecurity) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id="ctrps-producer",
        max_batch_size=_MAX_BATCH_BYTES,
        # The client expires a batch not acknowledged within its request
        # timeout (aiokafka has no separate delivery timeout): a dead broker
        # fails the sends within this, instead of 30 s per request and retry.
        request_timeout_ms=int(delivery_timeout_s * 1000),
        enable_idempotence=False,
        compression_type=None if compression == "none" else compression,
        **security.client_kwargs(),
    )


async def _start(producer: AIOKafkaProducer, bootstrap: str, report: ProduceReport, delivery_timeout_s: float) -> None:
    """Connect `producer`; `ProduceError` if the broker cannot be reached."""
    starting = asyncio.ensure_future(producer.start())
    try:
        await asyncio.shield(starting)
    except KafkaError as exc:
        await producer.stop()
        raise ProduceError(f"cannot connect to the broker at {bootstrap}: {type(exc).__name__}: {exc}", report) from exc
    except asyncio.CancelledError:
        # A stop asked while connecting: the client's start, cancelled, would
        # leave its bootstrap connection open, so it is let finish (bounded)
        # and the client stopped before the cancel goes on.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(delivery_timeout_s * 2):
                await starting
        await producer.stop()
        raise


async def _partitions(producer: AIOKafkaProducer, topic: str, partitions: int | None) -> list[int]:
    """The partitions to spread over: the topic's first `partitions`, or all of them."""
    available = sorted(await producer.partitions_for(topic))
    if partitions is not None:
        if not 1 <= partitions <= len(available):
            raise ValueError(f"topic {topic!r} has {len(available)} partitions; cannot use {partitions}")
        available = available[:partitions]
    return available


class _Pace:
    """A token bucket of `rate` events/s with at most ~1 s of burst."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    async def wait(self, enqueued: int) -> None:
        """Wait until the time of the `enqueued` events before has passed."""
        due = self._t0 + enqueued / self.rate
        now = self._loop.time()
        if due > now:
            await asyncio.sleep(due - now)
        elif now - due > 1.0:  # fell behind: forget the debt, no burst beyond ~1 s
            self._t0 = now - enqueued / self.rate - 1.0


class _Sender:
    """The chunks of one `produce` call: handed to Kafka by partition, settled
    in order, a chunk refused with error -1 resent."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        parts: list[int],
        report: ProduceReport,
        in_flight: collections.deque[_Sending],
        progress: Callable[[int], None] | None,
        delivery_timeout_s: float,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.parts = parts
        self.report = report
        self.in_flight = in_flight
        self.progress = progress
        self.delivery_timeout_s = delivery_timeout_s

    async def send_chunk(
        self, values: list[bytes], stamps: list[int | None], first: int
    ) -> tuple[asyncio.Future[Any], dict[int, int]]:
        """Hand one chunk to Kafka: event j goes to partition (first + j) % n_parts."""
        producer, topic, n_parts = self.producer, self.topic, len(self.parts)
        futures: list[asyncio.Future[Any]] = []
        counts: dict[int, int] = {}
        for k in range(n_parts):
            j0 = (k - first) % n_parts
            p = self.parts[k]
            batch = producer.create_batch()
            n = 0
            for value, ts in zip(values[j0::n_parts], stamps[j0::n_parts]):
                if batch.append(key=None, value=value, timestamp=ts) is None:
                    batch.close()  # full: send it, start another
                    futures.append(await producer.send_batch(batch, topic, partition=p))
                    batch = producer.create_batch()
                    batch.append(key=None, value=value, timestamp=ts)
                n += 1
            if n:
                batch.close()
                futures.append(await producer.send_batch(batch, topic, partition=p))
                counts[p] = n
        return asyncio.gather(*futures), counts

    async def send_all(self, chunks: AsyncIterator[list[Item]], rate: float | None, max_in_flight: int) -> None:
        """Encode and send every chunk, at most `max_in_flight` awaiting acknowledgement."""
        pace = None if rate is None else _Pace(rate)
        enqueued = 0  # events handed to Kafka; their partition is enqueued % n_parts
        async for chunk in chunks:
            values, stamps = _encode(chunk, self.report)
            if not values:
                continue
            if pace is not None:
                # Token bucket: the chunk may go once the previous events' time has passed.
                await pace.wait(enqueued)
            done, counts = await self.send_chunk(values, stamps, enqueued)
            self.in_flight.append(_Sending(done, counts, values, stamps, enqueued))
            enqueued += len(values)
            while len(self.in_flight) >= max_in_flight:
                await self.settle_oldest()
        while self.in_flight:
            await self.settle_oldest()

    async def settle_oldest(self) -> None:
        """Wait for the oldest chunk's acknowledgement (resending it on error -1) and count it."""
        sending = self.in_flight[0]
        while True:
            # The client's own expiry fails `done` first; this bound is the
            # backstop should a send hang past it (e.g. a frozen broker).
            # `asyncio.timeout`, not `wait_for`: on Python 3.11, wait_for
            # swallows a cancellation that arrives as the awaited future
            # completes, and a producer told to stop would go on producing.
            try:
                async with asyncio.timeout(self.delivery_timeout_s * 2):
                    await asyncio.shield(sending.done)
                break
            except UnknownError as exc:
                await self._resend(sending, exc)
        self.in_flight.popleft()
        report = self.report
        for p, n in sending.counts.items():
            report.partitions[p] += n
            report.sent += n
        report.bytes += sum(map(len, sending.values))
        if self.progress is not None:
            self.progress(report.sent)

    async def _resend(self, sending: _Sending, exc: UnknownError) -> None:
        # Error -1: the embedded broker (Tansu 0.6) acknowledges a batch sent
        # to a topic it does not have (one resent into it as it restarts,
        # empty) and then refuses the next write to that partition once.
        # Resent whole (at-least-once: its other partitions' records may be
        # sent twice), a bounded number of times.
        if sending.attempts >= UNKNOWN_ERROR_RETRIES:
            raise exc
        sending.attempts += 1
        log.warning(
            "the broker refused a send with error -1: resending it (the embedded broker "
            "answers so once per partition written to before its topic existed, as by a "
            "producer resending across its restart)",
            extra={
                "fields": {
                    "topic": self.topic,
                    "error": f"{type(exc).__name__}: {exc}",
                    "attempt": sending.attempts,
                    "of": UNKNOWN_ERROR_RETRIES,
                    "events": len(sending.values),
                }
            },
        )
        await asyncio.sleep(UNKNOWN_ERROR_BACKOFF_S * sending.attempts)
        sending.done, sending.counts = await self.send_chunk(sending.values, sending.stamps, sending.first)


async def produce(
    bootstrap: str,
    topic: str,
    events: EventSource,
    *,
    partitions: int | None = None,
    batch_size: int = 1000,
    progress: Callable[[int], None] | None = None,
    rate: float | None = None,
    max_in_flight: int = 4,
    delivery_timeout_s: float = 10.0,
    compression: str = "none",
    security: KafkaSecurity = KafkaSecurity(),
) -> ProduceReport:
    """Send `events` to `topic` and return what was sent.

    - `partitions`: spread over partitions ``0..partitions-1`` (at most the
      topic's count); ``None`` = all of the topic's partitions. Round-robin in
      event order, so counts differ by at most one.
    - `batch_size`: events encoded and handed to Kafka at a time; up to
      `max_in_flight` such chunks await acknowledgement at once.
    - `progress(sent)`: called after each chunk is acknowledged, with the total
      acknowledged so far (callers throttle their printing).
    - `rate`: events per second (wall time), paced per chunk by a token bucket
      with at most ~1 s of burst; chunks are shrunk to ~1/20 s of events so the
      pace is smooth. ``None`` = as fast as possible.
    - `delivery_timeout_s`: the longest a send waits for its acknowledgement
      (the client's request timeout, after which it expires queued batches);
      past it `DeliveryTimeout` is raised.
    - `compression`: the record batches' codec, one of `COMPRESSIONS`.
    - `security`: how the producer authenticates and encrypts (`KafkaSecurity`).

    Raises `DeliveryTimeout` when the broker stops acknowledging,
    `ProduceError` when it refuses a send (both carry the report of what was
    acknowledged), and `ValueError` for bad arguments or a topic with fewer
    partitions than asked.
    """
    _check_arguments(batch_size, max_in_flight, rate, delivery_timeout_s, compression)
    chunk_size = batch_size if rate is None else max(1, min(batch_size, int(rate / 20)))
    report = ProduceReport(topic)
    producer = _client(bootstrap, delivery_timeout_s, compression, security)
    in_flight: collections.deque[_Sending] = collections.deque()
    await _start(producer, bootstrap, report, delivery_timeout_s)
    try:
        parts = await _partitions(producer, topic, partitions)
        report.partitions = {p: 0 for p in parts}
        chunks: AsyncIterator[list[Item]] = (
            _achunks(events, chunk_size)
            if isinstance(events, AsyncIterable)
            else _as_async(_chunks(events, chunk_size))
        )
        start = time.perf_counter()
        sender = _Sender(producer, topic, parts, report, in_flight, progress, delivery_timeout_s)
        await sender.send_all(chunks, rate, max_in_flight)
        report.elapsed_s = time.perf_counter() - start
    except (TimeoutError, KafkaError) as exc:
        raise _failure(exc, report, bootstrap, topic, delivery_timeout_s) from exc
    finally:
        try:
            # Flushes what is still queued; against a dead broker the client
            # expires it within the request timeout, and this bounds the rest.
            async with asyncio.timeout(delivery_timeout_s * 2):
                await producer.stop()
        except (TimeoutError, KafkaError):
            pass  # the failure that brought us here is the one to report
        # After a failure, chunks still in flight are abandoned: retrieve their
        # outcome, now or when the client settles them (its stop cancels what it
        # still holds), so asyncio does not log "exception was never retrieved".
        for sending in in_flight:
            sending.done.add_done_callback(_retrieve)
    return report
