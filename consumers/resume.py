"""Checking the offsets a worker is told to resume from against the broker.

A restored model comes with the offsets its cut holds and the stream they
were read from (`ps_core.checkpoint.stream.StreamIdentity`). Before a worker seeks
there it asks the broker:

- its cluster id (``DescribeCluster``): another cluster — or the in-memory
  embedded broker after a restart, which gets a new id per start — holds
  other records at the same offsets;
- each partition's first offset and end (`partition_bounds`): an offset
  beyond the end (a topic recreated, a broker that lost its data) would fetch
  nothing forever on Tansu, and one before the start was deleted by retention.

What the worker does with offsets that fail these checks is its
``on_stale_offsets`` policy (`STALE_POLICIES`). The model's weights are kept
either way: events of the stream in front of the worker train on top of them.

The offsets that pass are then checked against the group's commits
(`uncovered`): events the group committed past what the shards' state holds
(a cut restored from before them, or shards started empty) were trained
into a state that is gone. They are replayed where the broker still holds
them; otherwise the worker stops (exit code 4) naming the range — or, for
shards started empty on purpose (``--no-restore``), says what the model
lacks. Never silently.

`Resumer` applies all of this for one worker: at each assignment, at a
rewind (a new coordinator epoch) and when the broker comes back as another
cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CorruptRecordException,
    IncompatibleBrokerVersion,
    KafkaError,
    UnsupportedCodecError,
    UnsupportedVersionError,
)

from ps_core.checkpoint.control import ControlClient, ResumePoint
from ps_core.checkpoint.stream import StreamIdentity, stream_mismatch

from .kafka_security import KafkaSecurity
from .outage import retrying_kafka
from .reports import WorkerStats

__all__ = [
    "Resumer",
    "STALE_POLICIES",
    "StaleOffsetsError",
    "StalePartition",
    "cluster_id",
    "partition_bounds",
    "bounds_reason",
    "Uncovered",
    "uncovered",
    "uncovered_line",
]

log = logging.getLogger("ctrps.worker")

STALE_POLICIES = ("committed", "earliest", "fail")
"""Values of ``on_stale_offsets``:

- ``committed`` (default): resume a partition at the group's own commit in
  the broker in front of the worker, or at its first offset where there is
  none (or it is out of range too);
- ``earliest``: at the partition's first offset;
- ``fail``: refuse to train (`StaleOffsetsError`, exit code 4)."""


class StaleOffsetsError(Exception):
    """The offsets to resume from do not belong to the broker's stream and
    the policy is ``fail``: an expected failure, one line, exit code 4."""

    exit_code = 4


@dataclass(frozen=True)
class StalePartition:
    """One partition whose resume offset failed a check."""

    partition: int
    offset: int
    """The offset the worker was told to resume from."""
    start: int
    """The partition's first offset in the broker."""
    end: int
    """The partition's end (next offset to be written)."""
    reason: str
    """``cluster``, ``group``, ``beyond_end`` or ``before_start``."""
    source: str
    """Where `offset` came from: ``coordinator`` (the restored cut) or ``group`` (the group's commit)."""
    resumed: int | None = None
    """Where the worker resumes instead (None under ``fail``)."""


def bounds_reason(offset: int, start: int, end: int) -> str | None:
    """``beyond_end`` / ``before_start`` when `offset` is outside ``[start, end]``."""
    if offset > end:
        return "beyond_end"
    if offset < start:
        return "before_start"
    return None


async def cluster_id(bootstrap: str, timeout_ms: int = 10_000, security: KafkaSecurity = KafkaSecurity()) -> str:
    """The cluster id the broker at `bootstrap` reports (``DescribeCluster``)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=timeout_ms, **security.client_kwargs())
    try:
        await admin.start()  # inside: a start that fails is closed too (an outage retries this)
        answer = await admin.describe_cluster()
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await admin.close()
    cid = answer.get("cluster_id") if isinstance(answer, dict) else None
    if not isinstance(cid, str) or not cid:
        raise KafkaError(f"the broker at {bootstrap} reported no cluster id")
    return cid


async def partition_bounds(
    bootstrap: str,
    partitions: Iterable[TopicPartition],
    timeout_s: float = 15.0,
    security: KafkaSecurity = KafkaSecurity(),
) -> dict[TopicPartition, tuple[int, int]]:
    """Each partition's first offset and end, as (start, end).

    The end is the high watermark of a fetch from the partition's first
    offset, not ``ListOffsets(latest)`` (`end_offsets`): Tansu 0.6 answers
    that with the last batch's base offset + 1, short of the end whenever a
    batch holds several records. A fetch's high watermark is right on Tansu
    and on Apache Kafka, and a fetch at the first offset is always in range.
    One short-lived consumer outside any group does the fetches.
    """
    tps = list(partitions)
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=64 << 10,
        **security.client_kwargs(),
    )
    try:
        await consumer.start()  # inside: a start that fails is stopped too (an outage retries this)
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, starts[tp])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(consumer.highwater(tp) is None for tp in tps):
            if loop.time() > deadline:
                missing = sorted(tp.partition for tp in tps if consumer.highwater(tp) is None)
                raise KafkaError(f"no fetch answer for partitions {missing} within {timeout_s:g} s")
            try:
                await consumer.getmany(timeout_ms=100, max_records=1)
            except (CorruptRecordException, UnsupportedCodecError):
                # The fetch answered (its high watermark is known); a batch
                # that cannot be decoded is the worker's to report, not the
                # bounds check's.
                pass
        return {tp: (int(starts[tp]), int(consumer.highwater(tp))) for tp in tps}
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await consumer.stop()


@dataclass(frozen=True)
class Uncovered:
    """Events of one partition the group committed that the shards' state
    does not hold: offsets ``[first, committed)``."""

    partition: int
    first: int
    """The first offset not in the model: the restored cut's offset, or 0
    when the cut (or the empty state) holds none of the partition."""
    committed: int
    """The group's commit (next offset to consume)."""
    start: int
    """The partition's first offset in the broker."""
    action: str
    """``replayed`` (the worker resumes at `first`, or at `start` under
    ``--on-stale-offsets earliest``), ``refused`` (not all held: exit code
    4) or ``lost`` (shards started empty: the worker resumes at the commit)."""

    @property
    def events(self) -> int:
        """Events in ``[first, committed)``."""
        return self.committed - self.first

    @property
    def resume_at(self) -> int:
        """Where the worker resumes the partition."""
        if self.action == "replayed":
            return max(self.first, self.start)
        return self.committed

    def range(self) -> str:
        """``partition:[first,committed)``, with the part not held when some is not."""
        gone = f" (not held: [{self.first},{self.start}))" if self.first < self.start else ""
        return f"{self.partition}:[{self.first},{self.committed}){gone}"


def uncovered(
    partition: int,
    cut: int | None,
    committed: int | None,
    start: int,
    restored: int | None,
    policy: str,
) -> Uncovered | None:
    """What the group committed on `partition` past the shards' state, or
    None when the state covers the commit (or nothing can be compared).

    `cut` is the coordinator's offset for the partition (None: it has none),
    `committed` the group's commit, `start` the partition's first offset in
    the broker, `restored` the version the shards' state was loaded from (0:
    started empty; None: a coordinator that does not say). A `cut` before
    `start` is a stale offset (`bounds_reason`), not handled here.
    """
    if restored is None or committed is None:
        return None
    if cut is not None:
        if start <= cut < committed:
            return Uncovered(partition, cut, committed, start, "replayed")
        return None
    if committed == 0:
        return None
    if restored == 0:
        # Shards started empty (``--no-restore`` or no exports): the group's
        # commits are kept, and the model lacks what they cover.
        return Uncovered(partition, 0, committed, start, "lost")
    # A restored cut that holds none of the partition: it was cut before the
    # first commit, so everything the group committed is to be trained again.
    held = start == 0 or policy == "earliest"
    return Uncovered(partition, 0, committed, start, "replayed" if held else "refused")


def uncovered_line(gaps: list[Uncovered], topic: str, restored: int) -> str:
    """The one line saying what the group committed that the model lacks,
    and what is done about it (all `gaps` share one action)."""
    action = gaps[0].action
    events = sum(g.events for g in gaps)
    ranges = " ".join(g.range() for g in gaps)
    if action == "lost":
        return (
            f"the shards started empty: {events} events the group committed are not in the model "
            f"and are not trained again; topic {topic} partition:[from,committed) {ranges}. "
            "To train them, start the workers in a new --group (it reads from the first offset held)"
        )
    state = f"restored version {restored}"
    if action == "refused":
        return (
            f"restore gap refused: {state} holds none of {events} events the group committed, and the broker "
            f"no longer holds them all; topic {topic} partition:[from,committed) {ranges}. "
            "--on-stale-offsets earliest replays what the broker holds and loses the rest"
        )
    replay = sum(g.committed - g.resume_at for g in gaps)
    lost = events - replay
    return (
        f"restore gap replayed: {state} does not hold {events} events the group committed; "
        f"{replay} are trained again from the broker"
        + (f", {lost} are no longer held and lost" if lost else "")
        + f"; topic {topic} partition:[from,committed) {ranges}"
    )


class Resumer:
    """Where a worker's partitions resume: the coordinator's offsets checked
    against the broker's stream, the group's commits checked against the
    shards' state, ``on_stale_offsets`` applied where they fail (one line,
    counted in `stats`). `committed` is the worker's own record of its
    commits (shared: stale ones are dropped from it)."""

    def __init__(
        self,
        control: ControlClient,
        stats: WorkerStats,
        committed: dict[tuple[str, int], int],
        *,
        bootstrap: str,
        group: str,
        topic: str,
        policy: str,
        security: KafkaSecurity = KafkaSecurity(),
    ) -> None:
        self.control = control
        self.stats = stats
        self.committed = committed
        self.bootstrap = bootstrap
        self.group = group
        self.topic = topic
        self.policy = policy
        """``on_stale_offsets`` (`STALE_POLICIES`)."""
        self.security = security
        self.cluster_id: str | None = None
        """The broker's cluster id, as last asked (None: it reports none)."""
        self.refusal: Exception | None = None
        """Set by an assignment whose offsets are refused (policy ``fail``),
        or could not be checked; the worker's consume loop raises it."""
        self.new_cluster: tuple[str, str] | None = None
        """(old, new) cluster id when the broker came back as another Kafka
        cluster: the worker starts every owned partition again."""

    async def assigned(self, consumer: Any, assigned: Any, *, leased: bool, model_key: str | None) -> None:
        """Seek partitions just `assigned` to `consumer` where they resume
        (`resume`). Normally that is the group's committed offset (each lease
        release reports the commit); after a restore it is the cut's offset,
        earlier than the group's, and the windows in between are trained
        again. A failure is kept in `refusal`, the partitions paused."""
        if not assigned:
            return
        # The consumer fetches from the group's commit as soon as partitions
        # are assigned, while this check awaits the broker: nothing fetched
        # before the seek may reach a window.
        consumer.pause(*assigned)
        try:
            moved = await self.resume(consumer, list(assigned), rewind=False, leased=leased, model_key=model_key)
        except Exception as exc:
            # Raised here it would only be logged by the Kafka client, and
            # the partitions would resume unchecked: fetch nothing, and let
            # the run loop raise it (a refusal, or the check's own failure).
            self.refusal = exc
            return
        consumer.resume(*assigned)
        if moved:
            log.info("seek", extra={"fields": {"offsets": {str(p): o for p, o in moved.items()}}})

    async def came_back(self) -> bool:
        """After the broker's outage: whether it is another Kafka cluster now
        (one that lost its topics, such as a memory broker restarted): then
        `new_cluster` is set, and no window may start until the worker has
        moved its partitions (`follow_new_cluster`)."""
        before = self.cluster_id
        try:
            await retrying_kafka(self.refresh_cluster_id)
        except (KafkaError, OSError) as exc:  # flapping: keep the positions, as before this check
            log.warning("cluster id not read after the outage", extra={"fields": {"error": repr(exc)}})
        if before is not None and self.cluster_id is not None and self.cluster_id != before:
            # The consumer's positions are offsets of the old cluster.
            self.new_cluster = (before, self.cluster_id)
            return True
        return False

    async def follow_new_cluster(self, consumer: Any, owned: Any, *, leased: bool, model_key: str | None) -> None:
        """Start every `owned` partition again at the new cluster's group
        commit, else at its first offset (a position kept from the old
        cluster skipped every record before it); the old cluster's commits
        are forgotten."""
        assert self.new_cluster is not None
        old, new = self.new_cluster
        self.committed.clear()
        moved: dict[int, int] = {}
        if owned:
            await consumer.seek_to_beginning(*owned)
            moved = await self.resume(consumer, list(owned), rewind=True, leased=leased, model_key=model_key)
        self.new_cluster = None
        log.warning(
            f"the broker is another Kafka cluster now ({new}, was {old}): what was fetched from the old one is "
            "dropped, every owned partition starts again at the new cluster's commit or its first offset",
            extra={
                "fields": {"cluster_id": new, "old_cluster_id": old, "offsets": {str(p): o for p, o in moved.items()}}
            },
        )

    def stream(self) -> StreamIdentity | None:
        """The stream this worker reads (None while the broker's cluster id is unknown)."""
        if self.cluster_id is None:
            return None
        return StreamIdentity(self.cluster_id, self.group, (self.topic,))

    async def refresh_cluster_id(self) -> None:
        try:
            self.cluster_id = await cluster_id(self.bootstrap, security=self.security)
        except (IncompatibleBrokerVersion, UnsupportedVersionError):
            if self.cluster_id is None:
                log.warning(
                    "the broker reports no cluster id: resume offsets are checked against partition bounds only"
                )
            self.cluster_id = None

    async def resume(
        self, consumer: Any, tps: list[TopicPartition], *, rewind: bool, leased: bool, model_key: str | None
    ) -> dict[int, int]:
        """Seek `tps` to the coordinator's offsets where they belong to the
        broker's stream; apply ``on_stale_offsets`` where they do not (one log
        line, counted). Returns the partitions sought and where.

        A partition the coordinator knows nothing of starts from the group's
        commit (checked the same way), or its first offset without one; with
        `rewind` (a new coordinator epoch) it is sought there explicitly,
        since the consumer's position has moved on. What the group committed past the shards' state is
        replayed, refused or reported (`report_gaps`)."""
        await retrying_kafka(self.refresh_cluster_id)
        point = await self.control.coordinator_resume(model_key) if leased else ResumePoint({}, None)
        bounds = await retrying_kafka(lambda: partition_bounds(self.bootstrap, tps, security=self.security))
        seek: dict[TopicPartition, int] = {}
        stale: list[StalePartition] = []
        gaps: list[Uncovered] = []
        actual = self.stream()
        mismatch = stream_mismatch(point.stream, actual) if actual is not None else None
        for tp in sorted(tps):  # per partition, on assignment only
            start, end = bounds[tp]
            cut = point.offsets.get(tp.topic, {}).get(tp.partition)
            group = self.committed.get((tp.topic, tp.partition)) if rewind else None
            if group is None and (cut is None or point.restored is not None):
                group = await consumer.committed(tp)
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
            policy = self.policy
            gap = None if mismatch else uncovered(tp.partition, cut, group, start, point.restored, policy)
            if gap is not None:
                gaps.append(gap)
                seek[tp] = gap.resume_at
            elif source == "coordinator" or rewind:
                seek[tp] = off
        if stale:
            seek.update(await self.stale(consumer, stale, point, tps))
        self.report_gaps(gaps, point)
        for tp, off in seek.items():
            consumer.seek(tp, off)
        return {tp.partition: off for tp, off in seek.items()}

    def report_gaps(self, gaps: list[Uncovered], point: ResumePoint) -> None:
        """One line per action for what the group committed that the shards'
        state lacks (`consumers.resume.uncovered`), counted; a gap the broker
        no longer holds refuses to train (`StaleOffsetsError`, exit code 4)."""
        restored = point.restored or 0
        for action in ("refused", "replayed", "lost"):
            these = [g for g in gaps if g.action == action]
            if not these:
                continue
            self.stats.stale_offsets[("uncovered", action)] += len(these)
            line = uncovered_line(these, self.topic, restored)
            if action == "refused":
                raise StaleOffsetsError(line)
            fields = {"restored": restored, "events": sum(g.events for g in these), "topic": self.topic}
            fields["partitions"] = " ".join(g.range() for g in these)
            log.warning(line, extra={"fields": fields})

    async def stale(
        self, consumer: Any, stale: list[StalePartition], point: ResumePoint, tps: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        """Apply ``on_stale_offsets`` to `stale` partitions: where to seek them
        instead, or `StaleOffsetsError` under ``fail``. One line, counted."""
        action = self.policy
        by_partition = {tp.partition: tp for tp in tps}
        for s in stale:
            self.stats.stale_offsets[(s.reason, action)] += 1
        if action == "fail":
            raise StaleOffsetsError(self.stale_line(stale, point, action))
        seek: dict[TopicPartition, int] = {}
        resolved = []
        for s in stale:
            tp = by_partition[s.partition]
            to = s.start
            if action == "committed" and s.source == "coordinator":
                group = await consumer.committed(tp)
                if group is not None and bounds_reason(group, s.start, s.end) is None:
                    to = group
            seek[tp] = to
            self.committed.pop((tp.topic, tp.partition), None)  # a commit of another stream
            resolved.append(StalePartition(s.partition, s.offset, s.start, s.end, s.reason, s.source, to))
        fields = self.stale_fields(resolved, point, action)
        log.warning(self.stale_line(resolved, point, action), extra={"fields": fields})
        return seek

    def stale_fields(self, stale: list[StalePartition], point: ResumePoint, action: str) -> dict[str, Any]:
        recorded = point.stream
        return {
            "reason": ",".join(sorted({s.reason for s in stale})),
            "action": action,
            "expected_cluster_id": recorded.cluster_id if recorded is not None else "-",
            "cluster_id": self.cluster_id or "-",
            "expected_group": recorded.group if recorded is not None else "-",
            "group": self.group,
            "topic": self.topic,
            # partition: offset [start, end) -> resumed
            "partitions": " ".join(
                f"{s.partition}:{s.offset}[{s.start},{s.end})"
                + (f"->{s.resumed}" if s.resumed is not None else "")
                + ("(group)" if s.source == "group" else "")
                for s in stale
            ),
        }

    def stale_line(self, stale: list[StalePartition], point: ResumePoint, action: str) -> str:
        """The one line saying what was found and what is done about it."""
        f = self.stale_fields(stale, point, action)
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

    async def refuse_stale_at_start(self, model_key: str | None) -> None:
        """Under ``fail``, refuse before joining the group when the
        coordinator's offsets for this topic do not belong to the broker."""
        point = await self.control.coordinator_resume(model_key)
        known = point.offsets.get(self.topic, {})
        if not known:
            return
        tps = [TopicPartition(self.topic, p) for p in sorted(known)]
        bounds = await partition_bounds(self.bootstrap, tps, security=self.security)
        actual = self.stream()
        mismatch = stream_mismatch(point.stream, actual) if actual is not None else None
        stale = [
            StalePartition(tp.partition, known[tp.partition], *bounds[tp], reason, "coordinator")
            for tp in tps
            if (reason := mismatch or bounds_reason(known[tp.partition], *bounds[tp])) is not None
        ]
        if stale:
            await self.stale(None, stale, point, tps)  # raises: the policy is ``fail``
