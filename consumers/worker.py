"""The training worker: a Kafka consumer in group ``ctrps`` that trains the
model from click events, one micro-batch window at a time.

Each window (`consumers.windows`) is decoded, trained and committed by the
pipeline (`consumers.pipeline`), its offsets committed only once every push
and every dead letter has been acknowledged.

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

`Worker` is a facade over one collaborator per concern, each tested alone:
`consumers.pipeline` (windows decoded, applied, committed), `outage_watch`
(outages waited out, the broker watched), `leases`, `resume` (where
partitions resume), `reports` (window reports, stats, the lag watch) and
`registration` (the models on the cluster). The worker itself builds its
Kafka clients and runs the consume loop.
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
from ps_core.model.geo import GeoCopy
from ps_core.model.models import Model
from ps_core.model.ramp import DEFAULT_RAMP
from ps_core.net.client import PSClient
from ps_core.store.table_config import MODES

from .collector import fewer_collections
from .decode import Decoded
from .dlq import DeadLetterQueue
from .kafka_security import KafkaSecurity, check_access
from .lag_watch import LagWatch
from .late_commits import late_commits_reported
from .leases import CoordinatorRestarted, Leases
from .outage import OutageWatch, UndecodableBatchError, is_outage, undecodable_batch
from .outage_watch import Outages, Stopped, stop_client
from .pipeline import AlsoTrained, Chunk, Pipeline
from .registration import Registration
from .reports import Reports, WindowReport, WorkerStats
from .resume import STALE_POLICIES, Resumer
from .training import AsyncTraining, GeoTraining, SyncTraining, Training
from .windows import TopicPartitionKey, Window, WindowBuilder

__all__ = ["WorkerConfig", "Worker", "WindowReport", "WorkerStats"]

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
    in_flight: int = 1
    """Async mode: mini-batches in flight at once; mini-batch k+D's pull rides
    with mini-batch k's push, so D round trips to the shards overlap
    (`consumers.training.AsyncTraining.in_flight`; capped by the model's
    ``max_staleness``)."""
    max_message_bytes: int = 1 << 20
    """Larger messages are dead-lettered as oversized."""
    decode_processes: int = 1
    """Processes decoding records; 0 decodes on the event loop (tests, tiny loads)."""
    session_timeout_ms: int = 10_000
    """Kafka group session timeout: how fast a dead worker's partitions move."""
    heartbeat_interval_ms: int = 1_000
    """Kafka heartbeat interval."""
    mode: str = "async"
    """Update mode (`ps_core.store.table_config.MODES`): ``async`` or ``geo``; the
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
        if self.in_flight < 1:
            raise ValueError("in_flight must be >= 1")
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

    # -- what the collaborators hold -----------------------------------------------
    @property
    def leased(self) -> bool:
        """Whether windows are leased from a coordinator (found at start)."""
        return self._leases.leased

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
        await self._leases.discover(outages.retrying, needed=c.mode == "sync")
        # The stream this worker reads; under ``fail`` a restored cut of
        # another stream is refused before anything starts. A broker not
        # there yet is waited for like any outage.
        await outages.until_listening()
        # A refused TLS handshake or login is not an outage to wait out: one
        # line and exit, rather than the client's "Unable to bootstrap" forever.
        await check_access(c.bootstrap, c.kafka)
        await outages.retrying(self._resumer.refresh_cluster_id, broker=True)
        if self.leased and c.on_stale_offsets == "fail":
            await self._resumer.refuse_stale_at_start(self._registration.key)
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
            await stop_client(self._consumer)  # leaves the group
        if self._producer is not None:
            await stop_client(self._producer)
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
        short-lived records at once; and a commit given up on that fails
        later in the client is one line, not a traceback
        (`consumers.late_commits`).
        """
        with fewer_collections(), late_commits_reported(self.stats):
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
        watch = asyncio.create_task(self._outages.watch_broker(self._resumer.came_back))
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
                undecodable = await undecodable_batch(
                    exc, self._consumer, self._committed, self.config.topic, self.config.bootstrap, self.config.kafka
                )
                where = {"topic": undecodable.topic, "partition": undecodable.partition}
                log.error(str(undecodable), extra={"fields": {**where, "offset": undecodable.offset}})
                break
            if await self._interrupted():
                continue
            pipeline.add(batches, self._models())
            await self._close_windows()
        # Stopping (or before an undecodable batch): finish what is buffered.
        await pipeline.finish(self._apply, lambda: self._outages.broker_down)
        if undecodable is not None:
            raise undecodable

    async def _interrupted(self) -> bool:
        """Whether the fetch just made is dropped: the broker came back as
        another cluster, or an assignment's offsets were refused or not
        checked (raised; or waited for, and checked again)."""
        resumer = self._resumer
        if resumer.new_cluster is not None:
            await self._follow_new_cluster()
            return True
        if resumer.refusal is None:
            return False
        refusal, resumer.refusal = resumer.refusal, None
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
            # While the broker is unreachable no window starts: its
            # commit could not be made.
            await pipeline.advance(self._apply, may_start=not self._outages.broker_down)
        except CoordinatorRestarted as restart:
            await pipeline.drop_applies()  # the windows queued behind fail the same way
            await self._rewind(restart.epoch)
        except Exception as exc:
            if not is_outage(exc):
                raise
            await self._recover(exc)

    async def _apply(self, window: Window, chunks: list[Chunk]) -> None:
        own = AlsoTrained(self.model, self.training, self.stats, self.on_window)
        await self._pipeline.apply(window, chunks, [own, *self.also])

    def _decode(self, values: list[bytes | None]) -> asyncio.Future[Decoded]:
        """Start decoding record values of one partition (in the pool when there is one)."""
        return self._pipeline.decode(values, self._models())

    # -- outages and rewinds -----------------------------------------------------------
    async def _follow_new_cluster(self) -> None:
        """The broker came back as another Kafka cluster (one that restarted
        empty): what was fetched or queued at the old cluster's offsets is
        dropped, never trained or committed, and every owned partition starts
        again (`Resumer.follow_new_cluster`)."""
        await self._pipeline.drop_applies()
        owned = self._consumer.assignment()
        self._pipeline.discard({(tp.topic, tp.partition) for tp in owned})
        await self._resumer.follow_new_cluster(
            self._consumer, owned, leased=self.leased, model_key=self._registration.key
        )
        self._outages.broker_down = False

    async def _recover(self, exc: BaseException) -> None:
        """After a window failed in an outage: the pipeline goes back to its
        first offsets (`Pipeline.replay`); wait until the dependency answers.
        The failed window is trained again, once."""
        since = time.monotonic()
        seq, moved = await self._pipeline.replay()
        self.stats.windows_replayed += 1
        self._reset_trainings()  # a geo copy's bases may not be what the shards hold now
        log.warning(
            "window failed in an outage: not committed, its partitions resume from its first offsets",
            extra={
                "fields": {
                    "window": seq,
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

    # -- partitions ------------------------------------------------------------------
    async def _on_assigned(self, assigned: Any) -> None:
        """Resume where the coordinator says the shards' state ends, once the
        offsets are checked against the broker (`Resumer.assigned`)."""
        await self._resumer.assigned(self._consumer, assigned, leased=self.leased, model_key=self._registration.key)

    async def _resume(self, tps: list[TopicPartition], *, rewind: bool) -> dict[int, int]:
        return await self._resumer.resume(
            self._consumer, tps, rewind=rewind, leased=self.leased, model_key=self._registration.key
        )

    async def _on_revoked(self, revoked: set[TopicPartitionKey]) -> None:
        if not revoked:  # the first join revokes nothing
            return
        dropped = await self._pipeline.revoke(revoked)  # an in-flight window finishes and commits first
        log.info(
            "revoked",
            extra={"fields": {"partitions": sorted(p for _, p in revoked), "dropped_records": dropped}},
        )

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
        return AsyncTraining(*common, ramp=c.mini_batch_ramp, in_flight=c.in_flight)

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
