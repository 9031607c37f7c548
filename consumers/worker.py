"""The training worker: a Kafka consumer in group ``ctrps`` that trains the
model from click events, one micro-batch window at a time.

For each window (`consumers.windows`):

1. decode, validate and hash its records in a process pool (`decode_records`);
2. send rejected records to the dead-letter topic, awaiting the broker's acks;
3. progressive validation: predict every event with the weights as they are
   before the window trains (one pull of the window's distinct ids), and
   compute log loss, AUC and COPC;
4. train in mini-batches: pull → gradients → push (update mode ``async``:
   each mini-batch's push applies on arrival, no barrier between workers);
5. commit, for partitions still assigned, the offsets after the window —
   only now, when every push and every dead letter has been acknowledged.

A window is applied at least once: if the worker dies before its commit, the
partition's next owner replays it (so a partition sees at most one window
applied twice). On revoke, an in-flight window finishes and commits first;
buffered records of revoked partitions are dropped for the new owner to read.
On stop (SIGTERM), the buffered window is finished and committed, then the
consumer leaves the group.

Outages (a shard, the coordinator or the broker unreachable) are waited out
(`consumers.outage`): nothing trains or commits meanwhile, one line every few
seconds says what is awaited, a window that failed part-way is trained again
from its first offsets, and past the outage deadline the worker gives up
(exit code 3). A record batch the Kafka client cannot decode stops the worker
before it, naming topic, partition and offset (exit code 1).

`Worker` is a facade over one collaborator per concern, each readable and
tested alone: `consumers.pipeline` (the open window, decoding, applying and
committing windows), `consumers.outage_watch` (outages waited out, the broker
watched), `consumers.leases` (a lease per window), `consumers.resume`
(`Resumer`: where partitions resume), `consumers.reports` (window reports,
stats, the lag watch) and `consumers.registration` (the models on the
cluster). The worker builds its Kafka clients and runs the consume loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError, UnsupportedCodecError

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.errors import NoCoordinatorError
from ps_core.model.geo import GeoCopy
from ps_core.model.models import Model
from ps_core.model.ramp import DEFAULT_RAMP
from ps_core.net.client import PSClient
from ps_core.store.table import MODES

from .collector import fewer_collections
from .decode import Decoded
from .dlq import DeadLetterQueue
from .kafka_security import KafkaSecurity, check_access
from .lag_watch import LagWatch
from .leases import CoordinatorRestarted, Leases
from .outage import OutageWatch, UndecodableBatchError, failed_partition, is_outage, locate_bad_batch, retrying_kafka
from .outage_watch import Outages, Stopped
from .pipeline import AlsoTrained, Chunk, ModelGoneError, Pipeline, first_offsets
from .registration import Registration
from .reports import Reports, WindowReport, WorkerStats
from .resume import STALE_POLICIES, Resumer
from .training import AsyncTraining, GeoTraining, SyncTraining, Training
from .windows import TopicPartitionKey, Window, WindowBuilder

__all__ = ["WorkerConfig", "Worker", "WindowReport", "WorkerStats", "ModelGoneError"]

log = logging.getLogger("ctrps.worker")

COMMIT_TIMEOUT_S = 30.0
"""How long one offset commit may take. The Kafka client retries a commit
for as long as the group coordinator answers with a retriable error (or not
at all) while the broker itself still accepts connections; past this the
window counts as failed in an outage and is trained again (at least once)."""

_DECODE_ERRORS = (CorruptRecordException, UnsupportedCodecError)
"""Kafka errors of a record batch the client cannot decode (any error that is
not a `KafkaError` counts too: a malformed batch can fail in the parser)."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides its client and model."""

    bootstrap: str
    """Kafka bootstrap servers."""
    topic: str = "clicks"
    """Topic of click events."""
    group: str = "ctrps"
    """Consumer group."""
    dlq_topic: str = "clicks.dlq"
    """Dead-letter topic."""
    window_seconds: float = 60.0
    """Window span in record time (and the wall-time bound of an open window)."""
    window_events: int = 100_000
    """Most records in one window."""
    mini_batch: int = 256
    """Events per pull/push step."""
    mini_batch_ramp: int = DEFAULT_RAMP
    """Async and geo modes: mini-batches start at `RAMP_START` events and grow by one
    per this many events trained, up to `mini_batch` (0: full from the first;
    `ps_core.model.ramp`)."""
    max_message_bytes: int = 1 << 20
    """Larger messages are dead-lettered as oversized."""
    decode_processes: int = 1
    """Processes decoding records; 0 decodes on the event loop (tests, tiny loads)."""
    session_timeout_ms: int = 10_000
    """Kafka group session timeout: how fast a dead worker's partitions move."""
    heartbeat_interval_ms: int = 1_000
    """Kafka heartbeat interval."""
    mode: str = "async"
    """Update mode (`ps_core.store.table.MODES`): ``async`` or ``geo``; the
    model's tables must be declared with the same."""
    geo_steps: int = 8
    """Geo: mini-batches trained on the local copy between pushes of its
    differences (a window's end pushes too)."""
    sync_deadline_s: float = 5.0
    """Sync: how long a step waits for a member after the first arrived,
    before closing without it (the quorum shrinks)."""
    geo_max_rows: int = 1_000_000
    """Geo: most rows the local copy keeps past a round (stale rows go first)."""
    worker_id: str = ""
    """Name in leases and logs; default ``<host>-<pid>``."""
    on_stale_offsets: str = "committed"
    """What to do with resume offsets that do not belong to the broker's
    stream (another cluster or group, beyond a partition's end or before its
    start): ``committed``, ``earliest`` or ``fail`` (`consumers.resume.STALE_POLICIES`)."""
    outage_deadline_s: float = 600.0
    """How long one outage (a shard, the coordinator or the broker unreachable)
    is waited out before the worker gives up; 0 waits forever."""
    outage_log_every_s: float = 5.0
    """Seconds between the lines saying what an outage waits for."""
    lag_warn_s: float = 120.0
    """A warning (repeated this often while it lasts) once the consumer lag
    has grown for this long (`consumers.lag_watch`); 0: no warning."""
    kafka: KafkaSecurity = KafkaSecurity()
    """How every Kafka client of the worker authenticates and encrypts
    (consumer, dead-letter producer, admin and offset lookups)."""

    def __post_init__(self) -> None:
        if self.on_stale_offsets not in STALE_POLICIES:
            raise ValueError(f"on_stale_offsets {self.on_stale_offsets!r} is not one of {', '.join(STALE_POLICIES)}")
        if self.mode not in MODES:
            raise ValueError(f"update mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 0 < self.sync_deadline_s <= 60:
            raise ValueError("sync_deadline_s must be in (0, 60]")
        if self.geo_steps < 1 or self.geo_max_rows < 1:
            raise ValueError("geo_steps and geo_max_rows must be >= 1")
        if self.window_seconds <= 0 or self.window_events < 1 or self.mini_batch < 1:
            raise ValueError("window_seconds, window_events and mini_batch must be positive")
        if self.mini_batch_ramp < 0:
            raise ValueError("mini_batch_ramp must be >= 0")
        if self.outage_deadline_s < 0 or not self.outage_log_every_s > 0:
            raise ValueError("outage_deadline_s must be >= 0 and outage_log_every_s positive")
        if not self.lag_warn_s >= 0:
            raise ValueError("lag_warn_s must be >= 0 (0: no warning)")


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._worker._on_revoked({(tp.topic, tp.partition) for tp in revoked})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("assigned", extra={"fields": {"partitions": sorted(tp.partition for tp in assigned)}})
        await self._worker._on_assigned(assigned)


async def _stop_client(client: Any) -> None:
    """Stop an aiokafka client, within 15 s. With the broker gone, the
    consumer's fetcher raises from `stop` the cancellation of its own fetch
    tasks: swallowed, unless this task itself is being cancelled."""
    try:
        await asyncio.wait_for(client.stop(), 15)
    except (TimeoutError, KafkaError):
        pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise


class Worker:
    """A training worker. ``await worker.run(stop)`` until `stop` is set."""

    def __init__(
        self,
        config: WorkerConfig,
        client: PSClient,
        control: ControlClient,
        model: Model,
        on_window: Callable[[WindowReport], Awaitable[None]] | None = None,
        *,
        also: Sequence[Model] = (),
    ) -> None:
        """`client` pulls and pushes; `control` declares the model's tables
        and takes leases from the coordinator. `on_window` is awaited after each window is committed (metrics,
        status reports); an exception from it is logged, never stops training.
        `also`: further models trained on the same records, in the worker's
        mode (in sync mode each model's steps meet at its own barrier; in geo
        mode each model has its own local copy)."""
        for m in (model, *also):
            if m.mode != config.mode:
                raise ValueError(
                    f"model {m.name}'s tables are declared for mode {m.mode}, the worker runs mode {config.mode}"
                )
        names = [model.name, *(m.name for m in also)]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is named twice: {', '.join(names)}")
        c = self.config = config
        self.client = client
        self.control = control
        self.model = model
        self.on_window = on_window
        self.stats = WorkerStats()
        self.worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.training = self._training()
        """How a window trains, in the model's update mode."""
        self.also = [self._also(m, WorkerStats()) for m in also]
        self._producer: Any = None
        self._registration = Registration(control)
        # A lease lives the group's session timeout unless renewed: a dead
        # worker's lease stops holding a cut when its group drops it.
        ttl_s = c.session_timeout_ms / 1000
        self._leases = Leases(control, self.worker_id, ttl_s, self.stats, c.outage_log_every_s)
        self._resumer = Resumer(
            control,
            self.stats,
            {},
            bootstrap=c.bootstrap,
            group=c.group,
            topic=c.topic,
            policy=c.on_stale_offsets,
            security=c.kafka,
        )
        self._reports = Reports(self.stats, LagWatch(c.lag_warn_s))
        watch = OutageWatch(c.outage_deadline_s, c.outage_log_every_s)
        self._outages = Outages(c.bootstrap, watch, self.stats, self._probe_shards)
        self._pipeline = Pipeline(
            WindowBuilder(c.window_seconds, c.window_events),
            max_message_bytes=c.max_message_bytes,
            commit_timeout_s=COMMIT_TIMEOUT_S,
            stats=self.stats,
            reports=self._reports,
            leases=self._leases,
            resumer=self._resumer,
            registration=self._registration,
        )
        # Set by an assignment whose offsets are refused (policy ``fail``),
        # or could not be checked; the run loop raises it.
        self._refusal: Exception | None = None
        self._new_cluster: tuple[str, str] | None = None
        """(old, new) cluster id when the broker came back as another Kafka
        cluster: the consume loop starts every owned partition again."""

    # -- what the collaborators hold -----------------------------------------------
    @property
    def leased(self) -> bool:
        """Whether windows are leased from a coordinator (found at start)."""
        return self._leases.leased

    @property
    def model_key(self) -> str | None:
        """The model's name as the coordinator keeps it (set once the model
        is created or found on the cluster; None: a coordinator without a
        model registry, which keeps one model's offsets)."""
        return self._registration.key

    @property
    def cluster_id(self) -> str | None:
        """The broker's cluster id, as last asked (None: it reports none)."""
        return self._resumer.cluster_id

    @property
    def _consumer(self) -> Any:
        """The Kafka consumer (None until started), which the pipeline reads."""
        return self._pipeline.consumer

    @_consumer.setter
    def _consumer(self, consumer: Any) -> None:
        self._pipeline.consumer = consumer

    @property
    def _dlq(self) -> DeadLetterQueue | None:
        return self._pipeline.dlq

    @_dlq.setter
    def _dlq(self, dlq: DeadLetterQueue | None) -> None:
        self._pipeline.dlq = dlq

    @property
    def _builder(self) -> WindowBuilder:
        return self._pipeline.builder

    @property
    def _lock(self) -> asyncio.Lock:
        return self._pipeline.lock

    @property
    def _committed(self) -> dict[TopicPartitionKey, int]:
        return self._resumer.committed

    @property
    def _pool(self) -> Any:
        return self._pipeline.pool

    def _models(self) -> list[Model]:
        """The worker's own model, then those trained beside it."""
        return [self.model, *(a.model for a in self.also)]

    # -- lifecycle -------------------------------------------------------------
    async def _start(self) -> None:
        c, outages = self.config, self._outages
        # Shards (or the broker, below) unreachable at start are waited for
        # like any outage.
        await outages.retrying(self._register_models)
        try:
            # An empty lease tells whether there is a coordinator, and its epoch.
            grant = await outages.retrying(self._leases.grant)
            await outages.retrying(lambda: self.control.release_lease(grant.lease_id, {}))
            self._leases.found(grant.epoch)
        except NoCoordinatorError:
            if c.mode == "sync":
                raise NoCoordinatorError(
                    "sync mode needs the coordinator's barrier, and shard 0 hosts no coordinator "
                    "(shard 0 runs with --no-exports; start it with an exports directory, or run --mode async)"
                ) from None
            log.info("no coordinator: windows are not leased and exports hold no offsets")
        # The stream this worker reads; under ``fail`` a restored cut of
        # another stream is refused before anything starts. A broker not
        # there yet is waited for like any outage.
        await outages.until_listening()
        # A refused TLS handshake or login is not an outage to wait out: one
        # line and exit, rather than the client's "Unable to bootstrap" forever.
        await check_access(c.bootstrap, c.kafka)
        await outages.retrying(self._resumer.refresh_cluster_id, broker=True)
        if self.leased and c.on_stale_offsets == "fail":
            await self._resumer.refuse_stale_at_start(self.model_key)
        if c.decode_processes > 0:
            self._pipeline.start_decoders(c.decode_processes, self.model.name)
        await self._start_kafka()

    async def _start_kafka(self) -> None:
        """Start the dead-letter producer, then the consumer (it joins the group)."""
        c = self.config

        def producer() -> Any:
            return AIOKafkaProducer(bootstrap_servers=c.bootstrap, linger_ms=5, **c.kafka.client_kwargs())

        def consumer() -> Any:
            made = AIOKafkaConsumer(
                bootstrap_servers=c.bootstrap,
                group_id=c.group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=c.session_timeout_ms,
                heartbeat_interval_ms=c.heartbeat_interval_ms,
                max_partition_fetch_bytes=max(c.max_message_bytes * 2, 1 << 20),
                fetch_max_bytes=max(c.max_message_bytes * 4, 50 << 20),
                **c.kafka.client_kwargs(),
            )
            made.subscribe([c.topic], listener=_Rebalance(self))
            return made

        await self._outages.start_kafka(producer, lambda made: setattr(self, "_producer", made))
        self._dlq = DeadLetterQueue(self._producer, c.dlq_topic)
        await self._outages.start_kafka(consumer, lambda made: setattr(self, "_consumer", made))

    async def _register_models(self) -> None:
        """Register the models (`consumers.registration`); a model the
        cluster declares otherwise trains as declared there."""
        adopted = await self._registration.register(self._models())
        if adopted[0] is not self.model:
            self.model = adopted[0]
            self.training = self._training()
        for i, (a, model) in enumerate(zip(self.also, adopted[1:])):
            if model is not a.model:
                fresh = self._also(model, a.stats)
                fresh.on_window = a.on_window
                self.also[i] = fresh

    async def _probe_shards(self) -> None:
        """Return once every shard answers (declaring the tables again, for a
        shard that restarted) and, with a coordinator, a lease is granted."""
        await self._registration.declare(self._models())
        if self.leased:
            await self._leases.probe()

    async def _close(self) -> None:
        # Bounded: with the broker gone, leaving the group or flushing the
        # producer would wait for it.
        if self._consumer is not None:
            await _stop_client(self._consumer)  # leaves the group
        if self._producer is not None:
            await _stop_client(self._producer)
        self._pipeline.close()
        self._consumer = self._producer = None

    async def run(self, stop: asyncio.Event) -> None:
        """Consume and train until `stop` is set; then finish the buffered
        window, commit, and leave the group.

        Windows are pipelined: while one window trains, the next closed one
        waits with its decoding done or under way, and a third fills, so the
        decode pool never waits for training. Applies and commits stay
        strictly in order.

        While it runs, the process's collector makes fewer young-generation
        collections (`consumers.collector`): fetches make thousands of
        short-lived records at once.
        """
        with fewer_collections():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        self._outages.stop = stop
        try:
            await self._start()
        except Stopped:
            await self._close()
            return
        applies = self._pipeline.applies
        main = asyncio.create_task(self._consume(stop))
        watch = asyncio.create_task(self._outages.watch_broker(self._came_back))
        lagging = asyncio.create_task(self._reports.watch_lag(self._consumer, self._committed))
        try:
            await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                # The broker watch gave up (its deadline passed) or failed.
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
                watch.result()
            with contextlib.suppress(Stopped):  # stopped in an outage: nothing left to commit
                main.result()
        finally:
            for task in (main, watch, lagging, *(t for t, _ in applies)):
                task.cancel()
            # Their outcome is moot: the error that brought us here is raised.
            await asyncio.gather(main, watch, lagging, *(t for t, _ in applies), return_exceptions=True)
            await self._close()

    # -- the consume loop ----------------------------------------------------------
    async def _consume(self, stop: asyncio.Event) -> None:
        undecodable: UndecodableBatchError | None = None
        pipeline = self._pipeline
        while not stop.is_set():
            # Never fetch past the window's capacity: a window holds at most
            # window_events records.
            room = self.config.window_events - len(pipeline.builder)
            try:
                batches = await self._consumer.getmany(timeout_ms=200, max_records=max(1, min(room, 20_000)))
            except Exception as exc:
                if is_outage(exc):
                    await asyncio.sleep(0.2)  # the client retries on its own
                    continue
                if isinstance(exc, KafkaError) and not isinstance(exc, _DECODE_ERRORS):
                    raise
                # A batch the client cannot decode. Fetching again would skip
                # the records fetched with it: stop here, apply and commit what
                # came before it, then fail naming it.
                undecodable = await self._undecodable(exc)
                where = {"topic": undecodable.topic, "partition": undecodable.partition}
                log.error(str(undecodable), extra={"fields": {**where, "offset": undecodable.offset}})
                break
            if await self._interrupted():
                continue
            pipeline.add(batches, self._models())
            await self._close_windows()
        await self._finish()
        if undecodable is not None:
            raise undecodable

    async def _interrupted(self) -> bool:
        """Whether the fetch just made is dropped: the broker came back as
        another cluster, or an assignment's offsets were refused or not
        checked (raised; or waited for, and checked again)."""
        if self._new_cluster is not None:
            await self._follow_new_cluster()
            return True
        if self._refusal is None:
            return False
        refusal, self._refusal = self._refusal, None
        if not is_outage(refusal):
            raise refusal
        # Shard 0 or the broker did not answer the check: wait for it,
        # then check the partitions (still paused) again.
        await self._outages.ride_out(refusal, self._outages.probe_for(refusal), time.monotonic())
        await self._on_assigned(self._consumer.assignment())
        return True

    async def _close_windows(self) -> None:
        """Queue the open window once it should close, raising the failure
        of a window applied before; a new coordinator rewinds, an outage
        recovers (`_recover`)."""
        pipeline = self._pipeline
        try:
            pipeline.reap()
            # While the broker is unreachable no window starts: its
            # commit could not be made.
            if not self._outages.broker_down and pipeline.builder.should_close():
                # Room first, then the window is taken: a window taken
                # while a failure surfaces here would be in neither the
                # builder nor the queue, and a recovery would miss it.
                await pipeline.make_room()
                if len(pipeline.builder):  # a revoke may have emptied it meanwhile
                    pipeline.enqueue(self._apply)
        except CoordinatorRestarted as restart:
            await pipeline.drop_applies()  # the windows queued behind fail the same way
            await self._rewind(restart.epoch)
        except Exception as exc:
            if not is_outage(exc):
                raise
            await self._recover(exc)

    async def _finish(self) -> None:
        """Stopping (or before an undecodable batch): finish what is buffered.
        While the broker is unreachable nothing can be committed: what is
        not is replayed from the committed offsets by the next owner."""
        pipeline, outages = self._pipeline, self._outages
        try:
            if len(pipeline.builder) and not outages.broker_down:
                pipeline.enqueue(self._apply)
            await pipeline.drain(lambda: outages.broker_down)
        except Exception as exc:
            if not is_outage(exc):
                raise
            # Stopping in an outage: what was not committed is replayed by
            # the partitions' next owner.
            log.warning(
                "stopped in an outage: the last windows are not committed and will be replayed",
                extra={"fields": {"error": str(exc)}},
            )

    async def _apply(self, window: Window, chunks: list[Chunk]) -> None:
        own = AlsoTrained(self.model, self.training, self.stats, self.on_window)
        await self._pipeline.apply(window, chunks, [own, *self.also])

    def _decode(self, values: list[bytes | None]) -> asyncio.Future[Decoded]:
        """Start decoding record values of one partition (in the pool when there is one)."""
        return self._pipeline.decode(values, self._models())

    # -- outages and rewinds -----------------------------------------------------------
    async def _came_back(self) -> bool:
        """After the broker's outage: whether it is another Kafka cluster now
        (one that lost its topics, such as a memory broker restarted)."""
        before = self.cluster_id
        try:
            await retrying_kafka(self._resumer.refresh_cluster_id)
        except (KafkaError, OSError) as exc:  # flapping: keep the positions, as before this check
            log.warning("cluster id not read after the outage", extra={"fields": {"error": repr(exc)}})
        if before is not None and self.cluster_id is not None and self.cluster_id != before:
            # The consumer's positions are offsets of the old cluster. No
            # window starts until the consume loop has moved them.
            self._new_cluster = (before, self.cluster_id)
            return True
        return False

    async def _follow_new_cluster(self) -> None:
        """The broker came back as another Kafka cluster (one that restarted
        empty): what was fetched or queued at the old cluster's offsets is
        dropped, never trained or committed, and every owned partition starts
        again at the new cluster's group commit, else at its first offset (a
        position kept from the old cluster skipped every record before it)."""
        assert self._new_cluster is not None
        old, new = self._new_cluster
        await self._pipeline.drop_applies()
        owned = self._consumer.assignment()
        self._pipeline.discard({(tp.topic, tp.partition) for tp in owned})
        self._committed.clear()  # the old cluster's commits
        moved: dict[int, int] = {}
        if owned:
            await self._consumer.seek_to_beginning(*owned)
            moved = await self._resume(list(owned), rewind=True)
        self._new_cluster = None
        self._outages.broker_down = False
        log.warning(
            f"the broker is another Kafka cluster now ({new}, was {old}): what was fetched from the old one is "
            "dropped, every owned partition starts again at the new cluster's commit or its first offset",
            extra={
                "fields": {"cluster_id": new, "old_cluster_id": old, "offsets": {str(p): o for p, o in moved.items()}}
            },
        )

    async def _recover(self, exc: BaseException) -> None:
        """After a window failed in an outage: drop it, the windows queued
        behind it and the buffered records; seek each of their partitions back
        to its first offset among them (the window's start: what was last
        committed, or applied and about to be); wait until the dependency
        answers. The failed window is trained again, once."""
        since = time.monotonic()
        pipeline = self._pipeline
        dropped = await pipeline.drop_applies()
        if len(pipeline.builder):
            buffered, chunks = pipeline.take()
            for _, _, fut in chunks:
                fut.cancel()
            dropped.append(buffered)
        first: dict[TopicPartitionKey, int] = {}
        for w in dropped:
            for tp, off in first_offsets(w).items():
                first[tp] = min(off, first.get(tp, off))
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        moved = {}
        for (topic, p), off in first.items():
            if (topic, p) in owned:
                self._consumer.seek(TopicPartition(topic, p), off)
                moved[p] = off
        self.stats.windows_replayed += 1
        self._reset_trainings()  # a geo copy's bases may not be what the shards hold now
        log.warning(
            "window failed in an outage: not committed, its partitions resume from its first offsets",
            extra={
                "fields": {
                    "window": dropped[0].seq if dropped else None,
                    "error": str(exc),
                    "resume": ",".join(f"{p}@{o}" for p, o in sorted(moved.items())),
                }
            },
        )
        await self._outages.ride_out(exc, self._outages.probe_for(exc), since)

    async def _rewind(self, epoch: str) -> None:
        """Resume every owned partition where the new coordinator's shards
        end (or at the group's commit where it knows nothing), dropping what
        is buffered: the windows after the cut are trained again, once. The
        offsets are checked against the broker as on assignment."""
        owned = self._consumer.assignment()
        self._pipeline.discard({(tp.topic, tp.partition) for tp in owned})
        await self._registration.declare(self._models())  # shards that restarted empty need them again
        moved = {str(p): o for p, o in (await self._resume(list(owned), rewind=True)).items()}
        self._leases.epoch = epoch
        self.stats.rewinds += 1
        self._reset_trainings()  # the shards went back to a cut
        log.warning("coordinator restarted: rewound", extra={"fields": {"epoch": epoch, "offsets": moved}})

    def _reset_trainings(self) -> None:
        self.training.reset()
        for a in self.also:
            a.training.reset()

    async def _undecodable(self, exc: Exception) -> UndecodableBatchError:
        """The error for a fetch that raised `exc` decoding a record batch:
        which partition, from which offset (located exactly by a reader of
        its own where it can be)."""
        found = failed_partition(exc, self._consumer)
        reason = f"{type(exc).__name__}: {exc}"
        if found is None:
            owned = sorted((tp.topic, tp.partition) for tp in self._consumer.assignment())
            topic, partition = owned[0] if len(owned) == 1 else (self.config.topic, -1)
        else:
            topic, partition = found
        if partition < 0:
            return UndecodableBatchError(topic, -1, -1, False, reason)
        tp = TopicPartition(topic, partition)
        start = self._committed.get((topic, partition), 0)
        with contextlib.suppress(Exception):
            start = await asyncio.wait_for(self._consumer.position(tp), 10)
        exact = await locate_bad_batch(self.config.bootstrap, topic, partition, start, security=self.config.kafka)
        return UndecodableBatchError(topic, partition, start if exact is None else exact, exact is not None, reason)

    # -- partitions ------------------------------------------------------------------
    async def _on_assigned(self, assigned: Any) -> None:
        """Resume where the coordinator says the shards' state ends, once the
        offsets are checked against the broker (`Resumer.resume`).

        Normally that is the group's committed offset (each lease release
        reports the commit); after a restore it is the cut's offset, earlier
        than the group's, and the windows in between are trained again.
        """
        if not assigned:
            return
        # The consumer fetches from the group's commit as soon as partitions
        # are assigned, while this check awaits the broker: nothing fetched
        # before the seek may reach a window.
        self._consumer.pause(*assigned)
        try:
            moved = await self._resume(list(assigned), rewind=False)
        except Exception as exc:
            # Raised here it would only be logged by the Kafka client, and
            # the partitions would resume unchecked: fetch nothing, and let
            # the run loop raise it (a refusal, or the check's own failure).
            self._refusal = exc
            return
        self._consumer.resume(*assigned)
        if moved:
            log.info("seek", extra={"fields": {"offsets": {str(p): o for p, o in moved.items()}}})

    async def _resume(self, tps: list[TopicPartition], *, rewind: bool) -> dict[int, int]:
        return await self._resumer.resume(
            self._consumer, tps, rewind=rewind, leased=self.leased, model_key=self.model_key
        )

    async def _on_revoked(self, revoked: set[TopicPartitionKey]) -> None:
        if not revoked:  # the first join revokes nothing
            return
        dropped = await self._pipeline.revoke(revoked)  # an in-flight window finishes and commits first
        log.info(
            "revoked",
            extra={"fields": {"partitions": sorted(p for _, p in revoked), "dropped_records": dropped}},
        )

    def stream(self) -> StreamIdentity | None:
        """The stream this worker reads (None while the broker's cluster id is unknown)."""
        return self._resumer.stream()

    # -- trainings -------------------------------------------------------------------
    def _also(self, model: Model, stats: WorkerStats) -> AlsoTrained:
        return AlsoTrained(model, self._training(model, stats), stats)

    def _training(self, model: Model | None = None, stats: WorkerStats | None = None) -> Training:
        """The training of `model` (the worker's own by default) in the
        update mode the worker runs."""
        c = self.config
        model = self.model if model is None else model
        common = (self.client, model, self.stats if stats is None else stats, c.mini_batch)  # every mode's
        if c.mode == "sync":
            return SyncTraining(*common, control=self.control, member=self.worker_id, deadline_s=c.sync_deadline_s)
        if c.mode == "geo":
            return GeoTraining(
                *common,
                geo_steps=c.geo_steps,
                max_rows=c.geo_max_rows,
                scale=lambda: self._geo_scale(),  # looked up per call: a test may set another
                ramp=c.mini_batch_ramp,
            )
        return AsyncTraining(*common, ramp=c.mini_batch_ramp)

    @property
    def geo(self) -> GeoCopy | None:
        """Geo mode: the rows this worker trains locally (None otherwise)."""
        return self.training.copy if isinstance(self.training, GeoTraining) else None

    def _geo_scale(self) -> float:
        """What a geo worker's differences are scaled by: its share of the
        topic's partitions (1/workers when they are spread evenly)."""
        total = self._consumer.partitions_for_topic(self.config.topic) if self._consumer is not None else None
        owned = sum(1 for tp in self._consumer.assignment() if tp.topic == self.config.topic) if total else 0
        return owned / len(total) if total and owned else 1.0
