"""A worker's consuming pipeline: records fetched go into the open window
(`consumers.windows.WindowBuilder`) and are decoded as they arrive, in jobs
of `DECODE_CHUNK` records (in a process pool when there is one); closed
windows queue (`APPLY_AHEAD`) and apply strictly in order, each under one
lease (`consumers.leases`):

1. decode, validate and hash its records in a process pool (`decode_records`);
2. send rejected records to the dead-letter topic, awaiting the broker's acks;
3. progressive validation: predict every event with the weights as they are
   before the window trains (one pull of the window's distinct ids), and
   compute log loss, AUC and COPC;
4. train in mini-batches: pull → gradients → push (update mode ``async``:
   each mini-batch's push applies on arrival, no barrier between workers);
5. commit, for partitions still assigned, the offsets after the window —
   only now, when every push and every dead letter has been acknowledged;
   then report it (`consumers.reports`) to each model's ``on_window``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaTimeoutError

from ps_core.checkpoint.coordinator import Offsets
from ps_core.errors import UnknownTableError
from ps_core.model.batch import EventBatch
from ps_core.model.metrics import Metrics
from ps_core.model.models import Model
from ps_core.waits import cancelled, within

from .decode import Decoded, Rejected, decode_records
from .decode_pool import start_decode_pool
from .dlq import DeadLetter, DeadLetterQueue
from .lag_watch import WindowTimes
from .leases import Leases
from .outage import is_outage
from .registration import Registration
from .reports import Reports, WindowReport, WorkerStats
from .resume import Resumer
from .training import Training
from .windows import TopicPartitionKey, Window, WindowBuilder

__all__ = ["DECODE_CHUNK", "APPLY_AHEAD", "Chunk", "AlsoTrained", "ModelGoneError", "Pipeline", "first_offsets"]

log = logging.getLogger("ctrps.worker")

DECODE_CHUNK = 2048
"""Most records in one decode job."""

APPLY_AHEAD = 3
"""Closed windows training or waiting to train while the next one fills (see
docs/measurements.md, "The worker": with 2 the decode process idled)."""

Chunk = tuple[TopicPartitionKey, int, "asyncio.Future[Decoded]"]
"""A decode job: its partition, its number of records, its decoding."""


class ModelGoneError(Exception):
    """The shards no longer hold a table of the model this worker trains
    (the model was deleted while it ran): nothing it trains can be kept."""

    exit_code = 1

    def __init__(self, model: str, detail: str) -> None:
        super().__init__(
            f"model {model} is gone from the shards ({detail}): it was deleted while this worker ran; "
            "stop its workers, or create it again (ctrps model create) and restart them"
        )


@dataclass
class AlsoTrained:
    """A model a worker trains beside its own, on the same records: one
    decode, one lease and one commit for all of them (``--also-train``)."""

    model: Model
    training: Training
    stats: WorkerStats = field(default_factory=WorkerStats)
    """Its own progress: events trained and the last window's progressive
    metrics; the record, commit and outage counts mirror the worker's."""
    on_window: Callable[[WindowReport], Awaitable[None]] | None = None
    """Awaited after each window with this model's report (its status)."""


def first_offsets(window: Window) -> dict[TopicPartitionKey, int]:
    """Each partition's first offset in `window` (one numpy pass per partition)."""
    out: dict[TopicPartitionKey, int] = {}
    for j, tp in enumerate(window.partitions):
        mine = window.offsets[window.record_partition == j]
        if mine.size:
            out[tp] = int(mine.min())
    return out


def _kept(
    batch: EventBatch, part: Decoded, keep_record: npt.NDArray[np.bool_] | None, first: int, size: int
) -> EventBatch:
    """`batch` (one chunk's, of `part`) without the events of records whose
    partitions were revoked (`keep_record` over the window; None keeps all),
    each event indexed by its record in the window (the chunk's start: `first`)."""
    record_of = np.asarray(part.record_of, dtype=np.int64)
    if keep_record is not None:
        keep = keep_record[first : first + size]
        batch = batch.select(np.flatnonzero(keep[record_of[batch.index]]))
    # Each event's index becomes its record in the window: what an event the
    # training leaves out (`Training.untrainable`) is dead-lettered as.
    return replace(batch, index=record_of[batch.index] + first)


def _settle(chunks: Sequence[Chunk]) -> None:
    """Cancel the decodings of `chunks` still under way, and retrieve the
    failures of those done: the window they belonged to is abandoned."""
    for _, _, fut in chunks:
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()


@dataclass
class _Trained:
    """What training one window gave: each model's progressive metrics (the
    worker's own first), the records rejected, and where the time went."""

    metrics: list[Metrics]
    rejected: list[Rejected]
    decode_s: float
    decode_wait_s: float
    train_s: float
    train_cpu_s: float


class Pipeline:
    """The open window, its decodings, the queue of closed windows and how
    each applies. `consumer` and `dlq` are the worker's Kafka clients (set
    once started); `committed` records what this worker committed per
    partition (shared with its `Resumer`)."""

    def __init__(
        self,
        builder: WindowBuilder,
        *,
        max_message_bytes: int,
        commit_timeout_s: float,
        stats: WorkerStats,
        reports: Reports,
        leases: Leases,
        resumer: Resumer,
        registration: Registration,
    ) -> None:
        self.builder = builder
        self.max_message_bytes = max_message_bytes
        self.commit_timeout_s = commit_timeout_s
        """How long one offset commit may take (`consumers.worker.COMMIT_TIMEOUT_S`)."""
        self.stats = stats
        self.reports = reports
        self.leases = leases
        self.resumer = resumer
        self.registration = registration
        self.committed = resumer.committed
        self.consumer: Any = None
        self.dlq: DeadLetterQueue | None = None
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.lock = asyncio.Lock()  # one window applies at a time (revoke waits for it)
        self.chunks: list[Chunk] = []
        """Decode jobs of the open window, in the order of its records."""
        self.applies: deque[tuple[asyncio.Task[None], Window]] = deque()
        """Apply tasks in window order, with their windows; each awaits its predecessor first."""
        self._warmup: asyncio.Future[Decoded] | None = None

    # -- the open window -----------------------------------------------------------
    def start_decoders(self, processes: int, model: str) -> None:
        """Spawn and warm `processes` decoders (imports, caches) while the
        consumer joins its group, not on the first window. The pool runs jobs
        in order, so the first real window queues behind this one."""
        self.pool = start_decode_pool(processes)
        sample: list[bytes | None] = [b'{"label": 0, "features": {"f": "v", "n": 1}}']
        self._warmup = asyncio.get_running_loop().run_in_executor(
            self.pool, decode_records, sample, model, self.max_message_bytes
        )

    def decode(self, values: list[bytes | None], models: Sequence[Model]) -> asyncio.Future[Decoded]:
        """Start decoding record values of one partition for `models` (the
        worker's own first; in the pool when there is one)."""
        own, *also = models
        beside = tuple((m.name, m.numeric) for m in also)
        args = (values, own.name, self.max_message_bytes, beside, own.numeric)
        if self.pool is None:
            fut: asyncio.Future[Decoded] = asyncio.get_running_loop().create_future()
            fut.set_result(decode_records(*args))
            return fut
        return asyncio.get_running_loop().run_in_executor(self.pool, decode_records, *args)

    def add(self, batches: dict[Any, list[Any]], models: Sequence[Model]) -> None:
        """Add fetched records to the open window, their decoding started."""
        for tp, records in batches.items():
            values = self.builder.add(records)
            # Decoding starts as records arrive, so it overlaps fetching
            # and training. Jobs of a few thousand records keep their
            # Python objects in cache (20k-record jobs decode ~1.3x
            # slower per event) and the per-job IPC small.
            key = (tp.topic, tp.partition)
            for i in range(0, len(values), DECODE_CHUNK):
                part = values[i : i + DECODE_CHUNK]
                self.chunks.append((key, len(part), self.decode(part, models)))

    def take(self) -> tuple[Window, list[Chunk]]:
        """Close the window, with its chunks' decodings (under way or done), in order."""
        window = self.builder.take()
        assert window is not None
        chunks, self.chunks = self.chunks, []
        assert sum(size for _, size, _ in chunks) == window.size
        return window, chunks

    def discard(self, partitions: set[TopicPartitionKey]) -> None:
        """Drop what the open window holds of `partitions` (every owned one)
        and every decoding under way."""
        self.builder.drop_partitions(partitions)
        for _, _, fut in self.chunks:
            fut.cancel()
        self.chunks = []

    async def revoke(self, revoked: set[TopicPartitionKey]) -> int:
        """Drop the records of `revoked` partitions, once an in-flight window
        has finished and committed; returns how many were dropped."""
        async with self.lock:
            dropped = self.builder.drop_partitions(revoked)
            keep = []
            for chunk in self.chunks:
                if chunk[0] in revoked:
                    chunk[2].cancel()  # its records are dropped with the partition
                else:
                    keep.append(chunk)
            self.chunks = keep
        return dropped

    # -- the queue of closed windows -----------------------------------------------
    def enqueue(self, apply: Callable[[Window, list[Chunk]], Awaitable[None]]) -> None:
        """Close the open window and queue `apply` of it behind the last queued."""
        window, chunks = self.take()
        prev = self.applies[-1][0] if self.applies else None

        async def after() -> None:
            if prev is not None:
                await prev  # its failure fails this window too: nothing applies out of order
            await apply(window, chunks)

        self.applies.append((asyncio.create_task(after()), window))

    def reap(self) -> None:
        """Drop the applied windows at the head of the queue, raising the
        failure of a window that failed (here, on the hot path)."""
        while self.applies and self.applies[0][0].done():
            self.applies[0][0].result()
            self.applies.popleft()

    async def make_room(self) -> None:
        """Wait until fewer than `APPLY_AHEAD` windows are queued."""
        while len(self.applies) >= APPLY_AHEAD:
            await self.applies[0][0]
            self.applies.popleft()

    async def advance(self, apply: Callable[[Window, list[Chunk]], Awaitable[None]], *, may_start: bool) -> None:
        """Drop the applied windows (raising a failed one's failure), and,
        when `may_start`, queue `apply` of the open window once it should close."""
        self.reap()
        if may_start and self.builder.should_close():
            # Room first, then the window is taken: a window taken while a
            # failure surfaces here would be in neither the builder nor the
            # queue, and a recovery would miss it.
            await self.make_room()
            if len(self.builder):  # a revoke may have emptied it meanwhile
                self.enqueue(apply)

    async def finish(
        self, apply: Callable[[Window, list[Chunk]], Awaitable[None]], broker_down: Callable[[], bool]
    ) -> None:
        """Stopping: queue `apply` of the open window and wait for every
        queued one. While `broker_down()` nothing can be committed: what is
        not is replayed from the committed offsets by the next owner, as in
        an outage."""
        try:
            if len(self.builder) and not broker_down():
                self.enqueue(apply)
            await self.drain(broker_down)
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning(
                "stopped in an outage: the last windows are not committed and will be replayed",
                extra={"fields": {"error": str(exc)}},
            )

    async def drop_applies(self) -> list[Window]:
        """Cancel every queued window (they fail the same way as the one
        before them); returns them."""
        dropped = [w for _, w in self.applies]
        for task, _ in self.applies:
            task.cancel()
        await asyncio.gather(*(t for t, _ in self.applies), return_exceptions=True)
        self.applies.clear()
        return dropped

    async def replay(self) -> tuple[int | None, dict[int, int]]:
        """After a window failed in an outage: drop it, the windows queued
        behind it and the open window, and seek each of their owned
        partitions back to its first offset among them (the window's start:
        what was last committed, or applied and about to be). Returns the
        failed window's number and the partitions sought, and where."""
        dropped = await self.drop_applies()
        if len(self.builder):
            buffered, chunks = self.take()
            for _, _, fut in chunks:
                fut.cancel()
            dropped.append(buffered)
        first: dict[TopicPartitionKey, int] = {}
        for w in dropped:
            for tp, off in first_offsets(w).items():
                first[tp] = min(off, first.get(tp, off))
        owned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        moved = {}
        for (topic, p), off in first.items():
            if (topic, p) in owned:
                self.consumer.seek(TopicPartition(topic, p), off)
                moved[p] = off
        return (dropped[0].seq if dropped else None), moved

    async def drain(self, broker_down: Callable[[], bool]) -> None:
        """Wait for the queued windows in order; while `broker_down()`,
        give up on them (not committed: replayed by the next owner)."""
        while self.applies:
            head = self.applies[0][0]
            await asyncio.wait({head}, timeout=0.5)
            if head.done():
                head.result()
                self.applies.popleft()
            elif broker_down():
                log.warning(
                    "stopped while the broker is unreachable: the last windows are not committed and will be replayed",
                    extra={"fields": {"windows": len(self.applies)}},
                )
                return

    def close(self) -> None:
        """Abandon the decodings of a window never applied, and stop the decoders."""
        _settle(self.chunks)
        self.chunks = []
        if self._warmup is not None:
            if not self._warmup.done():
                self._warmup.cancel()
            elif not self._warmup.cancelled() and self._warmup.exception() is not None:
                # A broken pool fails the warm-up too; the window that saw it
                # has raised already, so this one is only logged.
                log.warning("decoder warm-up failed", extra={"fields": {"error": repr(self._warmup.exception())}})
        self._warmup = None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None

    # -- one window ------------------------------------------------------------------
    def owned(self, window: Window) -> tuple[Window, npt.NDArray[np.bool_] | None]:
        """The window without partitions revoked since it closed (their new owner
        reads them again from the committed offset), and which of its records
        to keep (None: all)."""
        owned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        if all(tp in owned for tp in window.next_offsets):
            return window, None
        kept = replace(window, next_offsets={tp: o for tp, o in window.next_offsets.items() if tp in owned})
        return kept, window.in_partitions(owned)

    async def apply(self, window: Window, chunks: list[Chunk], models: Sequence[AlsoTrained]) -> None:
        """Train `models` (the worker's own first) on `window`, send its dead
        letters, commit it and report it to each model's ``on_window``."""
        async with self.lock:
            t0 = time.perf_counter()
            self.reports.lag_watch.window_began(time.monotonic())
            # Revocation waits for this lock, so what is owned now stays owned
            # until the commit.
            window, keep_record = self.owned(window)
            # The lease spans the window's pushes and commit: a cut holds the
            # whole window and its offsets, or neither.
            leases = self.leases
            lease = await leases.take() if leases.leased else None
            renewing = asyncio.create_task(leases.renewing(lease)) if lease is not None else None
            committed: Offsets = {}
            try:
                trained = await self._train(window, chunks, keep_record, models)
                # Dead letters go out before the commit that passes their offsets.
                assert self.dlq is not None
                await self.dlq.send_all(
                    [
                        DeadLetter(window.values[r.index], r.reason, r.detail, *window.source(r.index))
                        for r in trained.rejected
                    ]
                )
                committed = await self.commit(window)
            except UnknownTableError as exc:
                raise ModelGoneError(models[0].model.name, exc.detail) from None
            finally:
                _settle(chunks)  # a window that failed part-way: the failure raised is the training's
                if renewing is not None:
                    await cancelled(renewing)
                if lease is not None:
                    await self._release(lease, committed, models)
            hooks = self._report(window, trained, time.perf_counter() - t0, models)
        for hook, done in hooks:
            try:
                await hook(done)
            except Exception as exc:  # a status sink must never stop training
                log.warning(
                    "window hook failed: what it reports of this window is lost (training goes on)",
                    extra={"fields": {"window": done.window, "error": repr(exc)}},
                )

    async def _train(
        self,
        window: Window,
        chunks: list[Chunk],
        keep_record: npt.NDArray[np.bool_] | None,
        models: Sequence[AlsoTrained],
    ) -> _Trained:
        """Train each model on the window's events, as their decoding completes."""
        rejected: list[Rejected] = []
        decode_s = 0.0
        decode_wait_s = 0.0

        async def pieces() -> AsyncIterator[EventBatch]:
            """Each chunk's good events, as its decoding completes: training
            starts on a window's first chunk while the rest decode."""
            nonlocal decode_s, decode_wait_s
            first = 0  # the chunk's first record in the window
            for _, size, fut in chunks:
                t = time.perf_counter()
                part = await fut
                decode_wait_s += time.perf_counter() - t
                decode_s += part.seconds
                shifted = [Rejected(r.index + first, r.reason, r.detail) for r in part.rejected]
                if keep_record is not None:
                    shifted = [r for r in shifted if keep_record[r.index]]
                rejected.extend(shifted)
                yield _kept(part.batch, part, keep_record, first, size)
                first += size

        async def also_pieces(i: int) -> AsyncIterator[EventBatch]:
            """The same events hashed for the `i`-th model trained beside
            (decoded by then: the worker's own model awaited every chunk)."""
            first = 0
            for _, size, fut in chunks:
                part = await fut
                yield _kept(part.also[i], part, keep_record, first, size)
                first += size

        t_train, cpu_train = time.perf_counter(), time.process_time()
        for m in models:
            m.training.untrainable.clear()  # a failed window's, replayed now
        own, *also = models
        metrics = [await own.training.train(pieces(), window)]
        metrics += [await a.training.train(also_pieces(i), window) for i, a in enumerate(also)]
        t_trained, train_cpu_s = time.perf_counter(), time.process_time() - cpu_train
        # An event a model left out (gradients not finite): its record is a dead letter.
        left_out = {i: why for m in models for i, why in m.training.untrainable}
        rejected.extend(Rejected(i, "untrainable", why) for i, why in sorted(left_out.items()))
        return _Trained(metrics, rejected, decode_s, decode_wait_s, t_trained - t_train - decode_wait_s, train_cpu_s)

    def _report(
        self, window: Window, trained: _Trained, seconds: float, models: Sequence[AlsoTrained]
    ) -> list[tuple[Callable[[WindowReport], Awaitable[None]], WindowReport]]:
        """Each model's report of the window (counted), with its hook."""
        times = WindowTimes(seconds, trained.decode_wait_s, trained.train_s, trained.train_cpu_s)
        hooks = []
        for i, (m, metrics) in enumerate(zip(models, trained.metrics)):
            beside = None if i == 0 else (m.model.name, m.stats)
            lag = self.reports.lag(self.consumer, self.committed)
            done = self.reports.report(window, metrics, trained.rejected, times, trained.decode_s, lag, beside)
            if m.on_window is not None:
                hooks.append((m.on_window, done))
        return hooks

    async def _release(self, lease: int, committed: Offsets, models: Sequence[AlsoTrained]) -> None:
        key = self.registration.key
        # One window trained every model: its offsets are each model's.
        also = [m.model.name for m in models[1:]] if key is not None else []
        stream = self.resumer.stream() if committed else None
        await self.leases.release(lease, committed, stream=stream, model=key, also=also)

    async def commit(self, window: Window) -> Offsets:
        """Commit the window's offsets for partitions still owned; returns what was committed."""
        owned = self.consumer.assignment()
        offsets = {
            TopicPartition(t, p): off for (t, p), off in window.next_offsets.items() if TopicPartition(t, p) in owned
        }
        if not offsets:
            return {}
        try:
            await within(self.consumer.commit(offsets), self.commit_timeout_s)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced mid-window: the new owner replays it.
            self.stats.failed_commits += 1
            log.warning("commit failed", extra={"fields": {"window": window.seq, "error": str(exc)}})
            return {}
        except TimeoutError:
            # The group coordinator does not answer: an outage, the window is
            # trained again from its first offsets once the broker answers.
            self.stats.failed_commits += 1
            raise KafkaTimeoutError(
                f"commit of window {window.seq} not acknowledged within {self.commit_timeout_s:g} s"
            ) from None
        self.stats.commits += 1
        self.committed.update({(tp.topic, tp.partition): off for tp, off in offsets.items()})
        out: Offsets = {}
        for tp, off in offsets.items():
            out.setdefault(tp.topic, {})[tp.partition] = off
        return out
