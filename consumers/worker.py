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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    CorruptRecordException,
    IllegalStateError,
    IncompatibleBrokerVersion,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    UnsupportedCodecError,
    UnsupportedVersionError,
)

from ps_core.checkpoint.control import ControlClient, LeaseGrant, ResumePoint
from ps_core.checkpoint.coordinator import Offsets
from ps_core.checkpoint.registry import ModelSpec
from ps_core.checkpoint.stream import StreamIdentity, stream_mismatch
from ps_core.errors import (
    CutInProgressError,
    ModeConflictError,
    ModelConflictError,
    NoCoordinatorError,
    PSError,
    UnknownModelError,
    UnknownTableError,
)
from ps_core.model.batch import EventBatch
from ps_core.model.geo import GeoCopy
from ps_core.model.metrics import Metrics
from ps_core.model.models import Model
from ps_core.model.ramp import DEFAULT_RAMP
from ps_core.net.client import PSClient
from ps_core.store.table_config import MODES

from .broker import broker_listening
from .collector import fewer_collections
from .decode import Decoded, Rejected, decode_records
from .decode_pool import start_decode_pool
from .dlq import DeadLetter, DeadLetterQueue
from .kafka_security import KafkaSecurity, check_access
from .lag_watch import LagWatch, WindowTimes
from .outage import (
    OutageWatch,
    UndecodableBatchError,
    began,
    describe,
    failed_partition,
    is_outage,
    locate_bad_batch,
)
from .resume import (
    STALE_POLICIES,
    StaleOffsetsError,
    StalePartition,
    Uncovered,
    bounds_reason,
    cluster_id,
    partition_bounds,
    uncovered,
    uncovered_line,
)
from .training import AsyncTraining, GeoTraining, SyncTraining, Training
from .windows import TopicPartitionKey, Window, WindowBuilder

__all__ = ["WorkerConfig", "Worker", "WindowReport", "ModelGoneError"]

log = logging.getLogger("ctrps.worker")

DECODE_CHUNK = 2048
"""Most records in one decode job."""

LEASE_WAIT_S = 5.0
"""How long one lease request waits for a cut to end: well inside the
client's deadline (10 s), so the answer always reaches the worker."""

COMMIT_TIMEOUT_S = 30.0
"""How long one offset commit may take. The Kafka client retries a commit
for as long as the group coordinator answers with a retriable error (or not
at all) while the broker itself still accepts connections; past this the
window counts as failed in an outage and is trained again (at least once)."""

APPLY_AHEAD = 3
"""Closed windows training or waiting to train while the next one fills (see
docs/architecture.md, Workers: with 2 the decode process idled)."""


_Chunk = tuple[TopicPartitionKey, int, "asyncio.Future[Decoded]"]
"""A decode job: its partition, its number of records, its decoding."""

_T = TypeVar("_T")

_DECODE_ERRORS = (CorruptRecordException, UnsupportedCodecError)
"""Kafka errors of a record batch the client cannot decode (any error that is
not a `KafkaError` counts too: a malformed batch can fail in the parser)."""


def _first_offsets(window: Window) -> dict[TopicPartitionKey, int]:
    """Each partition's first offset in `window` (one numpy pass per partition)."""
    out: dict[TopicPartitionKey, int] = {}
    for j, tp in enumerate(window.partitions):
        mine = window.offsets[window.record_partition == j]
        if mine.size:
            out[tp] = int(mine.min())
    return out


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
        if self.outage_deadline_s < 0 or not self.outage_log_every_s > 0:
            raise ValueError("outage_deadline_s must be >= 0 and outage_log_every_s positive")
        if not self.lag_warn_s >= 0:
            raise ValueError("lag_warn_s must be >= 0 (0: no warning)")


@dataclass(frozen=True)
class WindowReport:
    """What one window did (one log line)."""

    window: int
    partitions: list[int]
    events: int
    records: int
    dlq: int
    metrics: Metrics
    events_per_s: float
    lag: int
    seconds: float
    decode_s: float = 0.0
    decode_wait_s: float = 0.0
    train_s: float = 0.0
    train_cpu_s: float = 0.0
    """The process's CPU time while the window trained (the rest of
    `train_s` waited, mostly on the shards)."""
    lag_by_partition: dict[int, int] = field(default_factory=dict)
    """Records behind per owned partition (highwater − committed), where known."""
    dlq_by_reason: dict[str, int] = field(default_factory=dict)
    """This window's dead letters by reason."""

    def fields(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "window": self.window,
            "partitions": ",".join(map(str, self.partitions)),
            "events": self.events,
            "dlq": self.dlq,
            "logloss": round(m.logloss, 5),
            "auc": round(m.auc, 4),
            "copc": round(m.copc, 3),
            # The window's own processing speed (events / its seconds), named
            # apart from a stream's throughput (the demo's and producer's events_per_s).
            "window_events_per_s": round(self.events_per_s),
            "lag": self.lag,
            "decode_ms": round(self.decode_s * 1000),
            "decode_wait_ms": round(self.decode_wait_s * 1000),
            "train_ms": round(self.train_s * 1000),
        }


@dataclass
class WorkerStats:
    """Running totals."""

    windows: int = 0
    records: int = 0
    events_trained: int = 0
    dead_letters: int = 0
    dead_letters_by_reason: Counter[str] = field(default_factory=Counter)
    commits: int = 0
    rewinds: int = 0
    """Times a restarted coordinator made the worker resume from its offsets."""
    failed_commits: int = 0
    stale_offsets: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Partitions whose resume offset failed a check, by (reason, action)."""
    outages: int = 0
    """Outages waited out (or being waited out): a shard, the coordinator or the broker unreachable."""
    outage_seconds: float = 0.0
    """Seconds spent waiting in outages that ended."""
    sync_steps: int = 0
    """Sync: steps this worker took part in."""
    geo_rounds: int = 0
    """Geo: pushes of the local copy's differences."""
    geo_full_refreshes: int = 0
    """Geo: rounds after which every row of the copy was read again (no
    complete answer from the shards' change logs)."""
    windows_replayed: int = 0
    """Windows that failed part-way in an outage: their partitions resumed from
    the window's first offsets, so that window is trained again."""
    waiting_for: str = ""
    """What the worker waits for now ("" when it is not waiting)."""
    lag_growing_s: float = 0.0
    """Seconds the consumer lag had been growing at its last sample, every
    few seconds (`consumers.lag_watch`; 0: not growing)."""
    lag_warnings: int = 0
    """Warnings that the consumer lag kept growing."""
    last: WindowReport | None = None
    history: list[WindowReport] = field(default_factory=list)


class _Stopped(Exception):
    """A stop request arrived while the worker waited out an outage."""


class ModelGoneError(Exception):
    """The shards no longer hold a table of the model this worker trains
    (the model was deleted while it ran): nothing it trains can be kept."""

    exit_code = 1

    def __init__(self, model: str, detail: str) -> None:
        super().__init__(
            f"model {model} is gone from the shards ({detail}): it was deleted while this worker ran; "
            "stop its workers, or create it again (ctrps model create) and restart them"
        )


class CoordinatorRestarted(Exception):
    """A lease came from a coordinator other than the one before (its epoch
    changed): the worker rewinds to that coordinator's offsets."""

    def __init__(self, epoch: str) -> None:
        super().__init__(f"coordinator epoch is now {epoch}")
        self.epoch = epoch


async def _retrying(call: Callable[[], Awaitable[_T]], attempts: int = 5, pause_s: float = 1.0) -> _T:
    """`call()`, tried again on a Kafka or socket error: a broker that has
    just come back (the group rejoins as soon as it answers) may refuse a
    first admin or fetch connection."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except (KafkaError, OSError):
            await asyncio.sleep(pause_s)
    return await call()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._worker._on_revoked({(tp.topic, tp.partition) for tp in revoked})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("assigned", extra={"fields": {"partitions": sorted(tp.partition for tp in assigned)}})
        await self._worker._on_assigned(assigned)


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
        self.config = config
        self.client = client
        self.control = control
        self.model = model
        self.on_window = on_window
        self.stats = WorkerStats()
        self._builder = WindowBuilder(config.window_seconds, config.window_events)
        self._lock = asyncio.Lock()  # one window applies at a time (revoke waits for it)
        self._consumer: Any = None
        self._producer: Any = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._dlq: DeadLetterQueue | None = None
        self._committed: dict[TopicPartitionKey, int] = {}
        self._warmup: asyncio.Future[Decoded] | None = None
        # Decode jobs of the open window, in the order of its records:
        # (partition, number of records, decoding).
        self._chunks: list[_Chunk] = []
        self.worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.training = self._training()
        self.also = [self._also(m, WorkerStats()) for m in also]
        """How a window trains, in the model's update mode."""
        self.leased = False
        """Whether windows are leased from a coordinator (found at start)."""
        self.model_key: str | None = None
        """The model's name as the coordinator keeps it (set once the model
        is created or found on the cluster; None: a coordinator without a
        model registry, which keeps one model's offsets)."""
        self._epoch: str | None = None
        self.cluster_id: str | None = None
        """The broker's cluster id, as last asked (None: it reports none)."""
        # Set by an assignment whose offsets are refused (policy ``fail``),
        # or could not be checked; the run loop raises it.
        self._refusal: Exception | None = None
        self._new_cluster: tuple[str, str] | None = None
        """(old, new) cluster id when the broker came back as another Kafka
        cluster: the consume loop starts every owned partition again."""
        self._outage = OutageWatch(config.outage_deadline_s, config.outage_log_every_s)
        self._lag_watch = LagWatch(config.lag_warn_s)
        self._broker_down = False
        """Set while the broker is unreachable: no window starts training."""
        self._stop = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------
    async def _start(self) -> None:
        c = self.config
        # Shards (or the broker, below) unreachable at start are waited for
        # like any outage.
        await self._retrying(self._register_model)
        try:
            # An empty lease tells whether there is a coordinator, and its epoch.
            grant = await self._retrying(self._grant)
            await self._retrying(lambda: self.control.release_lease(grant.lease_id, {}))
            self._epoch, self.leased = grant.epoch, True
        except NoCoordinatorError:
            if c.mode == "sync":
                raise NoCoordinatorError(
                    "sync mode needs the coordinator's barrier, and shard 0 hosts no coordinator "
                    "(shard 0 runs with --no-exports; start it with an exports directory, or run --mode async)"
                ) from None
            log.info("no coordinator: windows are not leased and exports hold no offsets")
        # The stream this worker reads; under ``fail`` a restored cut of
        # another stream is refused before anything starts. A broker not
        # there yet is waited for like any outage (probed first: the Kafka
        # client would log every attempt).
        since = time.monotonic()
        if not await broker_listening(c.bootstrap):
            await self._ride_out(KafkaConnectionError(), self._probe_broker, since)
        # A refused TLS handshake or login is not an outage to wait out: one
        # line and exit, rather than the client's "Unable to bootstrap" forever.
        await check_access(c.bootstrap, c.kafka)
        await self._retrying(self._refresh_cluster_id, broker=True)
        if self.leased and c.on_stale_offsets == "fail":
            await self._refuse_stale_at_start()
        if c.decode_processes > 0:
            self._pool = start_decode_pool(c.decode_processes)
            # Spawn and warm the decoders (imports, caches) while the consumer
            # joins its group, not on the first window. The pool runs jobs in
            # order, so the first real window queues behind this one.
            sample: list[bytes | None] = [b'{"label": 0, "features": {"f": "v", "n": 1}}']
            self._warmup = asyncio.get_running_loop().run_in_executor(
                self._pool, decode_records, sample, self.model.name, c.max_message_bytes
            )
        await self._start_kafka(
            "_producer", lambda: AIOKafkaProducer(bootstrap_servers=c.bootstrap, linger_ms=5, **c.kafka.client_kwargs())
        )
        self._dlq = DeadLetterQueue(self._producer, c.dlq_topic)

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

        await self._start_kafka("_consumer", consumer)

    # -- outages -----------------------------------------------------------------
    async def _declare_tables(self) -> None:
        for model in (self.model, *(a.model for a in self.also)):
            for t in model.tables():
                await self.control.declare(t)

    async def _register_model(self) -> None:
        """Declare the model's tables, and create the model on the cluster or
        take its declaration from it: a model created with ``ctrps model
        create`` trains with the optimizer it was created with. Another type
        or update mode than the worker's flags is `ModelConflictError` or
        `ModeConflictError` (one line, exit 1). A shard 0 without an exporter
        keeps no models: the tables are declared as the worker's flags say."""
        try:
            adopted = await self._as_created(self.model, strict_type=True)
        except NoCoordinatorError:
            await self._declare_tables()
            return
        if adopted is not self.model:
            self.model = adopted
            self.training = self._training()
        for i, a in enumerate(self.also):
            model = await self._as_created(a.model, strict_type=False)
            if model is not a.model:
                fresh = self._also(model, a.stats)
                fresh.on_window = a.on_window
                self.also[i] = fresh
        await self._declare_tables()
        for model in (self.model, *(a.model for a in self.also)):
            got = await self.control.create_model(ModelSpec.of(model).recipe())
            if got.get("created"):
                log.info("model created", extra={"fields": {"model": model.name, "type": model.kind}})
        self.model_key = self.model.name

    async def _as_created(self, model: Model, *, strict_type: bool) -> Model:
        """`model` as the cluster created it (its declaration), or `model`
        itself when nobody created it yet. Another update mode is
        `ModeConflictError`; with `strict_type`, another type is
        `ModelConflictError` (a model trained beside the worker's own takes
        the type it was created with)."""
        try:
            info = await self.control.model_info(model.name)
        except UnknownModelError:
            return model
        if info.get("type") is None:
            return model
        spec = ModelSpec.from_dict(info)
        if strict_type and spec.kind != model.kind:
            raise ModelConflictError(
                f"model {model.name} was created as {spec.kind}; this worker was started with --model {model.kind}"
            )
        if spec.mode != model.mode:
            raise ModeConflictError(
                f"model {model.name} is updated in mode {spec.mode}; this worker was started with --mode "
                f"{model.mode}: every worker of a model runs its mode"
            )
        if ModelSpec.of(model) == spec:
            return model
        log.info(
            "model declaration taken from the cluster",
            extra={"fields": {"model": model.name, "tables": ",".join(t.name for t in spec.tables)}},
        )
        return spec.build()

    async def _probe_shards(self) -> None:
        """Return once every shard answers (declaring the tables again, for a
        shard that restarted) and, with a coordinator, a lease is granted."""
        await self._declare_tables()
        if self.leased:
            # The epoch is not taken here: a new coordinator is found by the
            # next window's lease, which rewinds.
            grant = await self.control.acquire_lease(self.worker_id, wait_s=1.0, ttl_s=self._lease_ttl_s)
            await self.control.release_lease(grant.lease_id, {})

    async def _probe_broker(self) -> None:
        if not await broker_listening(self.config.bootstrap):
            raise KafkaConnectionError(f"nothing listening at {self.config.bootstrap}")

    async def _ride_out(
        self, exc: BaseException, probe: Callable[[], Awaitable[object]], since: float, *, stoppable: bool = True
    ) -> None:
        """Wait until `probe` succeeds after the outage `exc` (seen at `since`,
        or begun earlier where `exc` says: `began`),
        counting it; `OutageDeadlineError` past the deadline. When `stoppable`,
        a stop request ends the wait with `_Stopped`."""
        what = describe(exc, self.config.bootstrap)
        since = began(exc, since)  # the first unanswered request, not when its failure was seen
        s = self.stats
        s.outages += 1
        s.waiting_for = what
        wait = asyncio.create_task(self._outage.wait(what, probe, since))
        stopping = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({wait, stopping} if stoppable else {wait}, return_when=asyncio.FIRST_COMPLETED)
            if not wait.done():
                log.info(
                    "stop asked while waiting: nothing more is trained or committed",
                    extra={"fields": {"waiting_for": what}},
                )
                raise _Stopped()
            s.outage_seconds += wait.result()
        finally:
            s.waiting_for = ""
            for t in (wait, stopping):
                t.cancel()
            await asyncio.gather(wait, stopping, return_exceptions=True)

    async def _retrying(self, op: Callable[[], Awaitable[_T]], *, broker: bool = False) -> _T:
        """`op()`, waiting out the shards' (or, with `broker`, the broker's)
        outages between attempts."""
        probe = self._probe_broker if broker else self._probe_shards
        while True:
            since = time.monotonic()
            try:
                return await op()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await self._ride_out(exc, probe, since)

    async def _start_kafka(self, attr: str, make: Callable[[], Any]) -> None:
        """Start an aiokafka client from `make()` as attribute `attr`, waiting
        while nothing listens at the bootstrap address (one line every few
        seconds, not the client's own lines per attempt).

        The attribute is set before the client starts: a consumer may join its
        group, and call the rebalance listener, before `start` returns."""
        while True:
            since = time.monotonic()
            if not await broker_listening(self.config.bootstrap):
                await self._ride_out(KafkaConnectionError(), self._probe_broker, since)
            made = make()
            setattr(self, attr, made)
            try:
                await made.start()
                return
            except KafkaError as exc:
                setattr(self, attr, None)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(made.stop(), 10)
                if not is_outage(exc):
                    raise
                await self._ride_out(exc, self._probe_broker, since)

    async def _watch_broker(self) -> None:
        """While the worker runs: probe the broker every second; while it is
        unreachable, no window starts training, and one line every few seconds
        says so. Raises `OutageDeadlineError` past the deadline."""
        while True:
            await asyncio.sleep(self._outage.probe_every_s)
            since = time.monotonic()
            if await broker_listening(self.config.bootstrap):
                continue
            self._broker_down = True
            moved = False
            try:
                await self._ride_out(KafkaConnectionError(), self._probe_broker, since, stoppable=False)
                before = self.cluster_id
                try:
                    await _retrying(self._refresh_cluster_id)
                except (KafkaError, OSError) as exc:  # flapping: keep the positions, as before this check
                    log.warning("cluster id not read after the outage", extra={"fields": {"error": repr(exc)}})
                if before is not None and self.cluster_id is not None and self.cluster_id != before:
                    # A broker that lost its topics (a memory broker restarted):
                    # the consumer's positions are offsets of the old cluster.
                    # No window starts until the consume loop has moved them.
                    self._new_cluster, moved = (before, self.cluster_id), True
            finally:
                self._broker_down = moved

    async def _follow_new_cluster(self, applies: deque[tuple[asyncio.Task[None], Window]]) -> None:
        """The broker came back as another Kafka cluster (one that restarted
        empty): what was fetched or queued at the old cluster's offsets is
        dropped, never trained or committed, and every owned partition starts
        again at the new cluster's group commit, else at its first offset (a
        position kept from the old cluster skipped every record before it)."""
        assert self._new_cluster is not None
        old, new = self._new_cluster
        for task, _ in applies:
            task.cancel()
        await asyncio.gather(*(t for t, _ in applies), return_exceptions=True)
        applies.clear()
        owned = self._consumer.assignment()
        self._builder.drop_partitions({(tp.topic, tp.partition) for tp in owned})
        for _, _, fut in self._chunks:
            fut.cancel()
        self._chunks = []
        self._committed.clear()  # the old cluster's commits
        moved: dict[int, int] = {}
        if owned:
            await self._consumer.seek_to_beginning(*owned)
            moved = await self._resume(list(owned), rewind=True)
        self._new_cluster = None
        self._broker_down = False
        log.warning(
            f"the broker is another Kafka cluster now ({new}, was {old}): what was fetched from the old one is "
            "dropped, every owned partition starts again at the new cluster's commit or its first offset",
            extra={
                "fields": {"cluster_id": new, "old_cluster_id": old, "offsets": {str(p): o for p, o in moved.items()}}
            },
        )

    async def _recover(self, exc: BaseException, applies: deque[tuple[asyncio.Task[None], Window]]) -> None:
        """After a window failed in an outage: drop it, the windows queued
        behind it and the buffered records; seek each of their partitions back
        to its first offset among them (the window's start: what was last
        committed, or applied and about to be); wait until the dependency
        answers. The failed window is trained again, once."""
        since = time.monotonic()
        dropped = [w for _, w in applies]
        for task, _ in applies:
            task.cancel()
        await asyncio.gather(*(t for t, _ in applies), return_exceptions=True)
        applies.clear()
        if len(self._builder):
            buffered, chunks = self._take()
            for _, _, fut in chunks:
                fut.cancel()
            dropped.append(buffered)
        first: dict[TopicPartitionKey, int] = {}
        for w in dropped:
            for tp, off in _first_offsets(w).items():
                first[tp] = min(off, first.get(tp, off))
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        moved = {}
        for (topic, p), off in first.items():
            if (topic, p) in owned:
                self._consumer.seek(TopicPartition(topic, p), off)
                moved[p] = off
        self.stats.windows_replayed += 1
        self.training.reset()  # a geo copy's bases may not be what the shards hold now
        for a in self.also:
            a.training.reset()
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
        probe = self._probe_shards if isinstance(exc, PSError) else self._probe_broker
        await self._ride_out(exc, probe, since)

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

    async def _close(self) -> None:
        # Bounded: with the broker gone, leaving the group or flushing the
        # producer would wait for it.
        if self._consumer is not None:
            await _stop_client(self._consumer)  # leaves the group
        if self._producer is not None:
            await _stop_client(self._producer)
        for _, _, fut in self._chunks:  # decodings of a window that was never applied
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: the window it belonged to is abandoned
        self._chunks = []
        if self._warmup is not None:
            if not self._warmup.done():
                self._warmup.cancel()
            elif not self._warmup.cancelled() and self._warmup.exception() is not None:
                # A broken pool fails the warm-up too; the window that saw it
                # has raised already, so this one is only logged.
                log.warning("decoder warm-up failed", extra={"fields": {"error": repr(self._warmup.exception())}})
        self._warmup = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._consumer = self._producer = self._pool = None

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
        self._stop = stop
        try:
            await self._start()
        except _Stopped:
            await self._close()
            return
        # Apply tasks in window order, with their windows; each awaits its
        # predecessor first.
        applies: deque[tuple[asyncio.Task[None], Window]] = deque()
        main = asyncio.create_task(self._consume(stop, applies))
        watch = asyncio.create_task(self._watch_broker())
        lagging = asyncio.create_task(self._watch_lag())
        try:
            await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                # The broker watch gave up (its deadline passed) or failed.
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
                watch.result()
            with contextlib.suppress(_Stopped):  # stopped in an outage: nothing left to commit
                main.result()
        finally:
            for task in (main, watch, lagging, *(t for t, _ in applies)):
                task.cancel()
            # Their outcome is moot: the error that brought us here is raised.
            await asyncio.gather(main, watch, lagging, *(t for t, _ in applies), return_exceptions=True)
            await self._close()

    async def _consume(self, stop: asyncio.Event, applies: deque[tuple[asyncio.Task[None], Window]]) -> None:
        undecodable: UndecodableBatchError | None = None
        while not stop.is_set():
            # Never fetch past the window's capacity: a window holds at most
            # window_events records.
            room = self.config.window_events - len(self._builder)
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
                log.error(
                    str(undecodable),
                    extra={
                        "fields": {
                            "topic": undecodable.topic,
                            "partition": undecodable.partition,
                            "offset": undecodable.offset,
                        }
                    },
                )
                break
            if self._new_cluster is not None:
                await self._follow_new_cluster(applies)
                continue
            if self._refusal is not None:  # an assignment's offsets were refused, or not checked
                refusal, self._refusal = self._refusal, None
                if not is_outage(refusal):
                    raise refusal
                # Shard 0 or the broker did not answer the check: wait for it,
                # then check the partitions (still paused) again.
                probe = self._probe_shards if isinstance(refusal, PSError) else self._probe_broker
                await self._ride_out(refusal, probe, time.monotonic())
                await self._on_assigned(self._consumer.assignment())
                continue
            for tp, records in batches.items():
                values = self._builder.add(records)
                # Decoding starts as records arrive, so it overlaps fetching
                # and training. Jobs of a few thousand records keep their
                # Python objects in cache (20k-record jobs decode ~1.3x
                # slower per event) and the per-job IPC small.
                key = (tp.topic, tp.partition)
                for i in range(0, len(values), DECODE_CHUNK):
                    part = values[i : i + DECODE_CHUNK]
                    self._chunks.append((key, len(part), self._decode(part)))
            try:
                while applies and applies[0][0].done():
                    applies[0][0].result()  # re-raise a failed window here, on the hot path
                    applies.popleft()
                # While the broker is unreachable no window starts: its
                # commit could not be made.
                if not self._broker_down and self._builder.should_close():
                    # Room first, then the window is taken: a window taken
                    # while a failure surfaces here would be in neither the
                    # builder nor the queue, and a recovery would miss it.
                    while len(applies) >= APPLY_AHEAD:
                        await applies[0][0]
                        applies.popleft()
                    if len(self._builder):  # a revoke may have emptied it meanwhile
                        window, chunks = self._take()
                        prev = applies[-1][0] if applies else None
                        applies.append((asyncio.create_task(self._apply_after(prev, window, chunks)), window))
            except CoordinatorRestarted as restart:
                # The windows queued behind fail the same way: drop them.
                for task, _ in applies:
                    task.cancel()
                await asyncio.gather(*(t for t, _ in applies), return_exceptions=True)
                applies.clear()
                await self._rewind(restart.epoch)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await self._recover(exc, applies)
        # Stopping (or before an undecodable batch): finish what is buffered.
        # While the broker is unreachable nothing can be committed: what is
        # not is replayed from the committed offsets by the next owner.
        try:
            if len(self._builder) and not self._broker_down:
                window, chunks = self._take()
                prev = applies[-1][0] if applies else None
                applies.append((asyncio.create_task(self._apply_after(prev, window, chunks)), window))
            while applies:
                head = applies[0][0]
                await asyncio.wait({head}, timeout=0.5)
                if head.done():
                    head.result()
                    applies.popleft()
                elif self._broker_down:
                    log.warning(
                        "stopped while the broker is unreachable: the last windows are not "
                        "committed and will be replayed",
                        extra={"fields": {"windows": len(applies)}},
                    )
                    break
        except Exception as exc:
            if not is_outage(exc):
                raise
            # Stopping in an outage: what was not committed is replayed by
            # the partitions' next owner.
            log.warning(
                "stopped in an outage: the last windows are not committed and will be replayed",
                extra={"fields": {"error": str(exc)}},
            )
        if undecodable is not None:
            raise undecodable

    async def _apply_after(self, prev: asyncio.Task[None] | None, window: Window, chunks: list[_Chunk]) -> None:
        if prev is not None:
            await prev  # its failure fails this window too: nothing applies out of order
        await self._apply(window, chunks)

    # -- one window ------------------------------------------------------------
    async def _on_assigned(self, assigned: Any) -> None:
        """Resume where the coordinator says the shards' state ends, once the
        offsets are checked against the broker (`_resume`).

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

    def stream(self) -> StreamIdentity | None:
        """The stream this worker reads (None while the broker's cluster id is unknown)."""
        if self.cluster_id is None:
            return None
        return StreamIdentity(self.cluster_id, self.config.group, (self.config.topic,))

    async def _refresh_cluster_id(self) -> None:
        try:
            self.cluster_id = await cluster_id(self.config.bootstrap, security=self.config.kafka)
        except (IncompatibleBrokerVersion, UnsupportedVersionError):
            if self.cluster_id is None:
                log.warning(
                    "the broker reports no cluster id: resume offsets are checked against partition bounds only"
                )
            self.cluster_id = None

    async def _resume(self, tps: list[TopicPartition], *, rewind: bool) -> dict[int, int]:
        """Seek `tps` to the coordinator's offsets where they belong to the
        broker's stream; apply ``on_stale_offsets`` where they do not (one log
        line, counted). Returns the partitions sought and where.

        A partition the coordinator knows nothing of starts from the group's
        commit (checked the same way), or its first offset without one; with
        `rewind` (a new coordinator epoch) it is sought there explicitly,
        since the consumer's position has moved on. What the group committed past the shards' state is
        replayed, refused or reported (`_report_gaps`)."""
        await _retrying(self._refresh_cluster_id)
        point = await self.control.coordinator_resume(self.model_key) if self.leased else ResumePoint({}, None)
        bounds = await _retrying(lambda: partition_bounds(self.config.bootstrap, tps, security=self.config.kafka))
        seek: dict[TopicPartition, int] = {}
        stale: list[StalePartition] = []
        gaps: list[Uncovered] = []
        actual = self.stream()
        mismatch = stream_mismatch(point.stream, actual) if actual is not None else None
        for tp in sorted(tps):  # per partition, on assignment only
            start, end = bounds[tp]
            cut = point.offsets.get(tp.topic, {}).get(tp.partition)
            group = self._committed.get((tp.topic, tp.partition)) if rewind else None
            if group is None and (cut is None or point.restored is not None):
                group = await self._consumer.committed(tp)
            if cut is not None:
                off, source = cut, "coordinator"
                reason = mismatch or bounds_reason(off, start, end)
            elif group is not None:
                # The group's commit is the broker's own: only its range can be wrong.
                off, source, reason = group, "group", bounds_reason(group, start, end)
            elif rewind:
                # Nothing cut, nothing committed, but the consumer has fetched
                # on past what the rewind just dropped: back to the start.
                seek[tp] = start
                continue
            else:
                continue  # no commit: the consumer starts at the partition's first offset
            if reason is not None:
                stale.append(StalePartition(tp.partition, off, start, end, reason, source))
                continue
            policy = self.config.on_stale_offsets
            gap = None if mismatch else uncovered(tp.partition, cut, group, start, point.restored, policy)
            if gap is not None:
                gaps.append(gap)
                seek[tp] = gap.resume_at
            elif source == "coordinator" or rewind:
                seek[tp] = off
        if stale:
            seek.update(await self._stale(stale, point, tps))
        self._report_gaps(gaps, point)
        for tp, off in seek.items():
            self._consumer.seek(tp, off)
        return {tp.partition: off for tp, off in seek.items()}

    def _report_gaps(self, gaps: list[Uncovered], point: ResumePoint) -> None:
        """One line per action for what the group committed that the shards'
        state lacks (`consumers.resume.uncovered`), counted; a gap the broker
        no longer holds refuses to train (`StaleOffsetsError`, exit code 4)."""
        restored = point.restored or 0
        for action in ("refused", "replayed", "lost"):
            these = [g for g in gaps if g.action == action]
            if not these:
                continue
            self.stats.stale_offsets[("uncovered", action)] += len(these)
            line = uncovered_line(these, self.config.topic, restored)
            if action == "refused":
                raise StaleOffsetsError(line)
            fields = {"restored": restored, "events": sum(g.events for g in these), "topic": self.config.topic}
            fields["partitions"] = " ".join(g.range() for g in these)
            log.warning(line, extra={"fields": fields})

    async def _stale(
        self, stale: list[StalePartition], point: ResumePoint, tps: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        """Apply ``on_stale_offsets`` to `stale` partitions: where to seek them
        instead, or `StaleOffsetsError` under ``fail``. One line, counted."""
        action = self.config.on_stale_offsets
        by_partition = {tp.partition: tp for tp in tps}
        for s in stale:
            self.stats.stale_offsets[(s.reason, action)] += 1
        if action == "fail":
            raise StaleOffsetsError(self._stale_line(stale, point, action))
        seek: dict[TopicPartition, int] = {}
        resolved = []
        for s in stale:
            tp = by_partition[s.partition]
            to = s.start
            if action == "committed" and s.source == "coordinator":
                group = await self._consumer.committed(tp)
                if group is not None and bounds_reason(group, s.start, s.end) is None:
                    to = group
            seek[tp] = to
            self._committed.pop((tp.topic, tp.partition), None)  # a commit of another stream
            resolved.append(StalePartition(s.partition, s.offset, s.start, s.end, s.reason, s.source, to))
        fields = self._stale_fields(resolved, point, action)
        log.warning(self._stale_line(resolved, point, action), extra={"fields": fields})
        return seek

    def _stale_fields(self, stale: list[StalePartition], point: ResumePoint, action: str) -> dict[str, Any]:
        recorded = point.stream
        return {
            "reason": ",".join(sorted({s.reason for s in stale})),
            "action": action,
            "expected_cluster_id": recorded.cluster_id if recorded is not None else "-",
            "cluster_id": self.cluster_id or "-",
            "expected_group": recorded.group if recorded is not None else "-",
            "group": self.config.group,
            "topic": self.config.topic,
            # partition: offset [start, end) -> resumed
            "partitions": " ".join(
                f"{s.partition}:{s.offset}[{s.start},{s.end})"
                + (f"->{s.resumed}" if s.resumed is not None else "")
                + ("(group)" if s.source == "group" else "")
                for s in stale
            ),
        }

    def _stale_line(self, stale: list[StalePartition], point: ResumePoint, action: str) -> str:
        """The one line saying what was found and what is done about it."""
        f = self._stale_fields(stale, point, action)
        found = {
            "cluster": (
                f"the offsets were read from Kafka cluster {f['expected_cluster_id']}, this broker is {f['cluster_id']}"
            ),
            "group": f"the offsets were read by group {f['expected_group']}, this worker is in {f['group']}",
            "beyond_end": "offsets beyond the partition's end",
            "before_start": "offsets before the partition's first offset",
        }
        what = "; ".join(found[r] for r in f["reason"].split(","))
        where = f"topic {f['topic']} partition:offset[start,end) {f['partitions']}"
        if action == "fail":
            return (
                f"stale offsets refused (--on-stale-offsets fail): {what}; {where}. "
                "--on-stale-offsets committed or earliest resumes (the model's weights are kept), "
                "or restart the shards with --no-restore or a fresh --exports-dir"
            )
        at = "the partition's first offset" if action == "earliest" else "the group's commit (first offset where none)"
        # The fields follow the message on the line: topic, partitions, ids.
        return (
            f"stale offsets not applied: {what}; resuming at {at}; "
            "the model's weights are kept and this stream's events train on top of them"
        )

    async def _refuse_stale_at_start(self) -> None:
        """Under ``fail``, refuse before joining the group when the
        coordinator's offsets for this topic do not belong to the broker."""
        point = await self.control.coordinator_resume(self.model_key)
        known = point.offsets.get(self.config.topic, {})
        if not known:
            return
        tps = [TopicPartition(self.config.topic, p) for p in sorted(known)]
        bounds = await partition_bounds(self.config.bootstrap, tps, security=self.config.kafka)
        actual = self.stream()
        mismatch = stream_mismatch(point.stream, actual) if actual is not None else None
        stale = [
            StalePartition(tp.partition, known[tp.partition], *bounds[tp], reason, "coordinator")
            for tp in tps
            if (reason := mismatch or bounds_reason(known[tp.partition], *bounds[tp])) is not None
        ]
        if stale:
            await self._stale(stale, point, tps)

    async def _on_revoked(self, revoked: set[TopicPartitionKey]) -> None:
        if not revoked:  # the first join revokes nothing
            return
        async with self._lock:  # an in-flight window finishes and commits first
            dropped = self._builder.drop_partitions(revoked)
            keep = []
            for chunk in self._chunks:
                if chunk[0] in revoked:
                    chunk[2].cancel()  # its records are dropped with the partition
                else:
                    keep.append(chunk)
            self._chunks = keep
        log.info(
            "revoked",
            extra={"fields": {"partitions": sorted(p for _, p in revoked), "dropped_records": dropped}},
        )

    def _decode(self, values: list[bytes | None]) -> asyncio.Future[Decoded]:
        """Start decoding record values of one partition (in the pool when there is one)."""
        also = tuple((a.model.name, a.model.numeric) for a in self.also)
        args = (values, self.model.name, self.config.max_message_bytes, also, self.model.numeric)
        if self._pool is None:
            fut: asyncio.Future[Decoded] = asyncio.get_running_loop().create_future()
            fut.set_result(decode_records(*args))
            return fut
        return asyncio.get_running_loop().run_in_executor(self._pool, decode_records, *args)

    def _take(self) -> tuple[Window, list[_Chunk]]:
        """Close the window, with its chunks' decodings (under way or done), in order."""
        window = self._builder.take()
        assert window is not None
        chunks, self._chunks = self._chunks, []
        assert sum(size for _, size, _ in chunks) == window.size
        return window, chunks

    def _owned(self, window: Window) -> tuple[Window, npt.NDArray[np.bool_] | None]:
        """The window without partitions revoked since it closed (their new owner
        reads them again from the committed offset), and which of its records
        to keep (None: all)."""
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        if all(tp in owned for tp in window.next_offsets):
            return window, None
        kept = Window(
            seq=window.seq,
            values=window.values,
            partitions=window.partitions,
            record_partition=window.record_partition,
            offsets=window.offsets,
            next_offsets={tp: o for tp, o in window.next_offsets.items() if tp in owned},
            first_ts_ms=window.first_ts_ms,
            last_ts_ms=window.last_ts_ms,
        )
        return kept, window.in_partitions(owned)

    async def _apply(self, window: Window, chunks: list[_Chunk]) -> None:
        async with self._lock:
            t0 = time.perf_counter()
            self._lag_watch.window_began(time.monotonic())
            # Revocation waits for this lock, so what is owned now stays owned
            # until the commit.
            window, keep_record = self._owned(window)
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

            # The lease spans the window's pushes and commit: a cut holds the
            # whole window and its offsets, or neither.
            lease = await self._lease() if self.leased else None
            renewing = asyncio.create_task(self._renewing(lease)) if lease is not None else None
            committed: Offsets = {}
            try:
                t_train, cpu_train = time.perf_counter(), time.process_time()
                trainings = [self.training, *(a.training for a in self.also)]
                for tr in trainings:
                    tr.untrainable.clear()  # a failed window's, replayed now
                metrics = await self.training.train(pieces(), window)
                also_metrics = [await a.training.train(also_pieces(i), window) for i, a in enumerate(self.also)]
                t_trained, train_cpu_s = time.perf_counter(), time.process_time() - cpu_train
                # An event a model left out (gradients not finite): its record is a dead letter.
                left_out = {i: why for tr in trainings for i, why in tr.untrainable}
                rejected.extend(Rejected(i, "untrainable", why) for i, why in sorted(left_out.items()))
                # Dead letters go out before the commit that passes their offsets.
                assert self._dlq is not None
                await self._dlq.send_all(
                    [DeadLetter(window.values[r.index], r.reason, r.detail, *window.source(r.index)) for r in rejected]
                )
                committed = await self._commit(window)
            except UnknownTableError as exc:
                raise ModelGoneError(self.model.name, exc.detail) from None
            finally:
                for _, _, fut in chunks:  # a window that failed part-way
                    if not fut.done():
                        fut.cancel()
                    elif not fut.cancelled():
                        fut.exception()  # retrieved: the failure raised is the training's
                if renewing is not None:
                    renewing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewing
                if lease is not None:
                    await self._release(lease, committed)
            seconds, train_s = time.perf_counter() - t0, t_trained - t_train - decode_wait_s
            hooks = [
                (
                    hook,
                    self._report(window, m, rejected, seconds, decode_s, decode_wait_s, train_s, train_cpu_s, also=a),
                )
                for hook, m, a in (
                    (self.on_window, metrics, None),
                    *((a.on_window, m, a) for a, m in zip(self.also, also_metrics)),
                )
            ]
        for hook, done in hooks:
            if hook is None:
                continue
            try:
                await hook(done)
            except Exception as exc:  # a status sink must never stop training
                log.warning(
                    "window hook failed: what it reports of this window is lost (training goes on)",
                    extra={"fields": {"window": done.window, "error": repr(exc)}},
                )

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

    async def _commit(self, window: Window) -> Offsets:
        """Commit the window's offsets for partitions still owned; returns what was committed."""
        owned = self._consumer.assignment()
        offsets = {
            TopicPartition(t, p): off for (t, p), off in window.next_offsets.items() if TopicPartition(t, p) in owned
        }
        if not offsets:
            return {}
        try:
            await asyncio.wait_for(self._consumer.commit(offsets), COMMIT_TIMEOUT_S)
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
                f"commit of window {window.seq} not acknowledged within {COMMIT_TIMEOUT_S:g} s"
            ) from None
        self.stats.commits += 1
        self._committed.update({(tp.topic, tp.partition): off for tp, off in offsets.items()})
        out: Offsets = {}
        for tp, off in offsets.items():
            out.setdefault(tp.topic, {})[tp.partition] = off
        return out

    @property
    def _lease_ttl_s(self) -> float:
        """A lease lives the group's session timeout unless renewed: a dead
        worker's lease stops holding a cut when its group drops it."""
        return self.config.session_timeout_ms / 1000

    async def _grant(self) -> LeaseGrant:
        """A lease; while a cut pauses, asks again, one line every few
        seconds saying what the cut waits for (the coordinator's words)."""
        since = time.monotonic()
        next_line = since
        waited = False
        try:
            while True:
                try:
                    return await self.control.acquire_lease(
                        self.worker_id, wait_s=LEASE_WAIT_S, ttl_s=self._lease_ttl_s
                    )
                except CutInProgressError as exc:
                    # Short waits keep every answer within the client's
                    # deadline, so no lease is granted to a caller that has
                    # given up. A cut pauses at most until the leases it
                    # waits for end.
                    if not waited:  # counted as an outage (its metrics), named as the cut
                        self.stats.outages += 1
                        waited = True
                    self.stats.waiting_for = "a cut to finish"
                    now = time.monotonic()
                    if now >= next_line:
                        next_line = now + self._outage.log_every_s
                        log.warning(
                            f"waiting for a cut to finish for {now - since:.0f}s: {exc.detail}; "
                            "not training or committing",
                            extra={"fields": {"waiting_for": "a cut to finish", "waited_s": round(now - since, 1)}},
                        )
        finally:
            if waited:
                self.stats.outage_seconds += time.monotonic() - since
            if self.stats.waiting_for == "a cut to finish":
                self.stats.waiting_for = ""

    async def _renewing(self, lease_id: int) -> None:
        """Renew a lease every third of its time to live while its window
        trains (cancelled at its release)."""
        failed = False
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            try:
                if not await self.control.renew_lease(lease_id):
                    log.warning(
                        "lease expired while its window trained: a cut may hold part of the window",
                        extra={"fields": {"lease": lease_id}},
                    )
                    return
            except PSError as exc:  # shard 0 unreachable: the window's own calls wait it out
                if not failed:  # once per lease
                    log.warning("lease renewal failed", extra={"fields": {"lease": lease_id, "error": str(exc)}})
                failed = True

    async def _lease(self) -> int:
        grant = await self._grant()
        if self._epoch is not None and grant.epoch != self._epoch:
            # A new coordinator: the shards may hold an older cut than this
            # worker's commits. Train nothing more from where we are.
            await self._release(grant.lease_id, {})
            raise CoordinatorRestarted(grant.epoch)
        self._epoch = grant.epoch
        return grant.lease_id

    async def _rewind(self, epoch: str) -> None:
        """Resume every owned partition where the new coordinator's shards
        end (or at the group's commit where it knows nothing), dropping what
        is buffered: the windows after the cut are trained again, once. The
        offsets are checked against the broker as on assignment."""
        owned = self._consumer.assignment()
        self._builder.drop_partitions({(tp.topic, tp.partition) for tp in owned})
        for _, _, fut in self._chunks:
            fut.cancel()
        self._chunks = []
        await self._declare_tables()  # shards that restarted empty need them again
        moved = {str(p): o for p, o in (await self._resume(list(owned), rewind=True)).items()}
        self._epoch = epoch
        self.stats.rewinds += 1
        self.training.reset()  # the shards went back to a cut
        for a in self.also:
            a.training.reset()
        log.warning("coordinator restarted: rewound", extra={"fields": {"epoch": epoch, "offsets": moved}})

    async def _release(self, lease_id: int, committed: Offsets) -> None:
        try:
            stream = self.stream() if committed else None
            # One window trained every model: its offsets are each model's.
            also = [a.model.name for a in self.also] if self.model_key is not None else []
            if not await self.control.release_lease(
                lease_id, committed, stream=stream, model=self.model_key, also=also
            ):
                log.warning("lease expired", extra={"fields": {"lease": lease_id}})
        except PSError as exc:
            # The window is committed (or failed); a cut gives up on the lease
            # when it expires, and the committed offsets are the group's.
            log.warning("lease release failed", extra={"fields": {"lease": lease_id, "error": str(exc)}})

    def _lag(self) -> dict[int, int]:
        """Records behind per owned partition: highwater − next offset to apply."""
        lag: dict[int, int] = {}
        for tp in self._consumer.assignment():
            hw = self._consumer.highwater(tp)
            done = self._committed.get((tp.topic, tp.partition))
            if hw is not None and done is not None:
                lag[tp.partition] = max(0, hw - done)
        return lag

    def _report(
        self,
        window: Window,
        metrics: Metrics,
        rejected: list[Rejected],
        seconds: float,
        decode_s: float,
        decode_wait_s: float,
        train_s: float,
        train_cpu_s: float,
        also: AlsoTrained | None = None,
    ) -> WindowReport:
        """The window's report, counted in the worker's stats (or, for a model
        trained beside, in that model's, which mirror the worker's counts)."""
        lag = self._lag()
        report = WindowReport(
            window=window.seq,
            partitions=sorted({p for _, p in window.next_offsets}),
            events=metrics.events,
            records=window.size,
            dlq=len(rejected),
            metrics=metrics,
            events_per_s=metrics.events / seconds if seconds > 0 else 0.0,
            lag=sum(lag.values()),
            seconds=seconds,
            decode_s=decode_s,
            decode_wait_s=decode_wait_s,
            train_s=train_s,
            train_cpu_s=train_cpu_s,
            lag_by_partition=lag,
            dlq_by_reason=dict(Counter(r.reason for r in rejected)),
        )
        s = self.stats if also is None else also.stats
        s.windows += 1
        s.records += window.size
        s.dead_letters += report.dlq
        s.dead_letters_by_reason.update(report.dlq_by_reason)
        s.last = report
        s.history.append(report)
        del s.history[:-1000]
        if also is not None:
            w = self.stats
            s.commits, s.failed_commits, s.rewinds = w.commits, w.failed_commits, w.rewinds
            s.outages, s.outage_seconds, s.windows_replayed = w.outages, w.outage_seconds, w.windows_replayed
            s.stale_offsets = Counter(w.stale_offsets)
            log.info("window", extra={"fields": {**report.fields(), "model": also.model.name}})
        else:
            log.info("window", extra={"fields": report.fields()})
            self._lag_watch.window(WindowTimes(seconds, decode_wait_s, train_s, train_cpu_s))
        return report

    async def _watch_lag(self) -> None:
        """While the worker runs: every few seconds, the lag of its partitions
        (the broker's end offsets less the commits) to the lag watch, its
        line logged and its figures in the stats. Outages reset it."""
        watch, s = self._lag_watch, self.stats
        if watch.warn_after_s <= 0:
            return
        while True:
            await asyncio.sleep(watch.every_s)
            known = [tp for tp in self._consumer.assignment() if (tp.topic, tp.partition) in self._committed]
            if s.waiting_for:
                watch.reset()
            elif known:
                try:
                    ends = await asyncio.wait_for(self._consumer.end_offsets(known), 10)
                except (KafkaError, OSError, TimeoutError):
                    continue  # the broker's own watch says when it is away
                # Tansu 0.6 answers end_offsets with the last batch's base
                # offset + 1 (short by up to a batch); the consumer's high
                # watermark is right but only as fresh as its last fetch.
                ends = {tp: max(ends[tp], self._consumer.highwater(tp) or 0) for tp in known}
                lag = sum(max(0, ends[tp] - self._committed[(tp.topic, tp.partition)]) for tp in known)
                parts = frozenset(tp.partition for tp in known)
                notice = watch.observe(time.monotonic(), lag, s.records, s.events_trained, parts)
                if notice is not None:
                    log.log(notice.level, notice.message, extra={"fields": notice.fields})
            s.lag_growing_s, s.lag_warnings = watch.growing_s, watch.warnings
