"""Consistent cuts: leases around workers' windows, export versions, offsets.

A worker holds a lease while it applies a window: from its first pull to the
commit of its offsets. A cut

1. stops granting leases and waits for the active ones to be released (a
   lease neither released nor renewed within its time to live belongs to a
   dead worker and stops counting: its window is replayed by whoever takes
   its partitions; a worker asks for its group's session timeout and renews
   while its window trains, so a dead worker's lease ends as soon as its
   group would drop it);
2. has every shard snapshot its rows (the pause: a memory copy);
3. records the offsets the workers committed with their released leases;
4. grants leases again. Files are written after this, outside the pause.

So a cut holds whole windows only, and its offsets say exactly which: a
restore that seeks to them applies nothing twice and loses nothing.

`Coordinator` is pure asyncio: the caller supplies the snapshot step (the
shard fan-out), so it runs in a shard server, in-process in ``ctrps demo``, or
in a test with real shards and no sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import ClusterNotReadyError, CutInProgressError, InvalidRequestError, LeaseError, PSError
from ..parsing import json_int, parse_int
from ..waits import within
from .barrier import MAX_DEADLINE_S, SyncBarrier
from .stream import StreamIdentity, stream_mismatch

__all__ = ["Coordinator", "Lease", "Cut", "Offsets", "parse_offsets"]

Offsets = dict[str, dict[int, int]]
"""Next offset to consume, by topic and partition."""

T = TypeVar("T")

MAX_TOPIC_CHARS = 249
"""Kafka's limit on a topic name."""
MAX_PARTITION = 10**9 - 1
"""Highest partition number taken (at most nine ASCII digits, as on the
status board: `ps_core.store.board.PARTITION_KEY`); Kafka's int32 allows more,
no topic has that many."""
MAX_BARRIERS = 1024
"""Models with a sync barrier at most (one per model, kept for its counts)."""

log = logging.getLogger("ctrps.coordinator")


@dataclass(frozen=True)
class Lease:
    """Permission to apply one window."""

    lease_id: int
    """Identifies the lease in `release`."""
    worker: str
    """Who holds it (for logs and expiry reports)."""
    expires_at: float
    """Monotonic time after which a cut stops waiting for it."""
    epoch: str = ""
    """The granting coordinator's `Coordinator.epoch`."""
    ttl_s: float = 0.0
    """How long it lives without a release or renewal (`Coordinator.renew`)."""
    granted_at: float = 0.0
    """Monotonic time it was granted."""


@dataclass(frozen=True)
class Cut(Generic[T]):
    """What one cut produced."""

    version: int
    """The version of this cut."""
    parent: int | None
    """The previous version (None for the first)."""
    kind: str
    """``base`` (every row) or ``delta`` (rows changed since `parent`)."""
    offsets: Offsets
    """Committed offsets of every window the cut holds."""
    snapshot: T
    """What the snapshot step returned (the shards' copies)."""
    lease_wait_s: float
    """How long the cut waited for active leases."""
    pause_s: float
    """How long leases were refused: the wait plus the snapshot."""
    expired_leases: list[str] = field(default_factory=list)
    """Workers whose leases expired during the wait."""
    stream: StreamIdentity | None = None
    """The stream `offsets` were read from (None: no worker reported one)."""
    books: dict[str, tuple[Offsets, StreamIdentity | None]] = field(default_factory=dict)
    """Every model's offsets and their stream (`offsets` and `stream` are
    the default model's)."""


class OffsetBook:
    """One model's committed offsets and the stream they were read from."""

    def __init__(self, offsets: Mapping[str, Mapping[int, int]] | None = None, stream: StreamIdentity | None = None):
        self.offsets: Offsets = {t: dict(p) for t, p in (offsets or {}).items()}
        self.stream = stream
        self.stream_changes = 0
        """Times workers reported a stream other than the one the offsets were read from."""

    def record(
        self, offsets: Mapping[str, Mapping[int, int]] | None, stream: StreamIdentity | None, model: str
    ) -> None:
        """Record offsets a window committed, read from `stream`."""
        if offsets and stream is not None:
            self._adopt(stream.with_topics(list(offsets)), model)
        for topic, parts in (offsets or {}).items():
            self.offsets.setdefault(topic, {}).update({int(p): int(o) for p, o in parts.items()})

    def copy(self) -> Offsets:
        return {t: dict(p) for t, p in self.offsets.items()}

    def _adopt(self, stream: StreamIdentity, model: str) -> None:
        """Record `stream` as the offsets' stream; a different one drops the old offsets."""
        old = self.stream
        reason = stream_mismatch(old, stream)
        if old is not None and reason is not None:  # a recorded stream, and another one
            log.warning(
                "stream changed: offsets of the old stream dropped",
                extra={
                    "fields": {
                        "model": model,
                        "reason": reason,
                        "old_cluster_id": old.cluster_id,
                        "cluster_id": stream.cluster_id,
                        "old_group": old.group,
                        "group": stream.group,
                        "dropped_partitions": sum(len(p) for p in self.offsets.values()),
                    }
                },
            )
            self.offsets = {}
            self.stream_changes += 1
            self.stream = stream
        elif old is None:
            self.stream = stream
        else:
            self.stream = old.with_topics(stream.topics)


def parse_offsets(raw: object, *, error: type[PSError] = LeaseError) -> Offsets:
    """Offsets from JSON (``{"topic": {"partition": offset}}``, partitions as
    strings of ASCII digits, offsets JSON integers, both non-negative);
    `error` on anything else (a route passes its 400)."""
    if not isinstance(raw, dict):
        raise error(f"offsets must be an object of topics, got {type(raw).__name__}")
    out: Offsets = {}
    for topic, parts in raw.items():
        if not isinstance(parts, dict) or not 0 < len(topic) <= MAX_TOPIC_CHARS:
            raise error(f"offsets of topic {topic[:40]!r} must be an object of partitions")
        out[topic] = {
            parse_int(p, f"partition {p[:20]!r} of topic {topic[:40]!r}", maximum=MAX_PARTITION, error=error): json_int(
                o, f"offset of topic {topic[:40]!r}", error=error
            )
            for p, o in parts.items()
        }
    return out


class Coordinator:
    """Leases and cuts for one model's shards (one per deployment).

    `lease_ttl_s` bounds how long a cut waits for one window unrenewed: make
    it longer than a window takes to apply. A lease asked for with a shorter
    time to live (a worker's session timeout) lasts that long unless
    renewed. Every `base_every`-th cut (and the first)
    is a base.
    """

    def __init__(
        self,
        *,
        lease_ttl_s: float = 120.0,
        base_every: int = 10,
        last_version: int = 0,
        last_base: int = 0,
        offsets: Mapping[str, Mapping[int, int]] | None = None,
        version: int = 0,
        stream: StreamIdentity | None = None,
        model: str = "ctr",
        books: Mapping[str, tuple[Mapping[str, Mapping[int, int]], StreamIdentity | None]] | None = None,
    ) -> None:
        """`last_version`, `last_base`, `offsets` and their `stream` resume
        after a restore; `version` is the export version the shards hold (the
        offsets'). `offsets` and `stream` are those of `model`, the default
        model (the one a request naming none means); `books`, other models'."""
        if lease_ttl_s <= 0 or base_every < 1:
            raise ValueError("lease_ttl_s must be > 0 and base_every >= 1")
        self.lease_ttl_s = lease_ttl_s
        self.base_every = base_every
        self.last_version = last_version
        """The newest cut (0: none yet)."""
        self.last_base = last_base
        """The newest base cut (0: none yet)."""
        self.model = model
        """The default model: the one whose offsets a request naming none means."""
        self._books: dict[str, OffsetBook] = {n: OffsetBook(o, st) for n, (o, st) in (books or {}).items()}
        self._books[model] = OffsetBook(offsets, stream)
        self._ids = itertools.count(1)
        self._active: dict[int, Lease] = {}
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Condition()
        self._cut_lock = asyncio.Lock()
        self.epoch = secrets.token_hex(8)
        """This coordinator's life. Workers compare it between leases: a new
        one means the coordinator restarted, perhaps with shards restored to
        a cut, and the workers must resume from its offsets."""
        self.sync_max_deadline_s = MAX_DEADLINE_S
        """The longest any sync step waits (`SyncBarrier.max_deadline_s`)."""
        self.barriers: dict[str, SyncBarrier] = {}
        """The sync mode's barriers of the workers' steps, one per model
        (`barrier`): the workers of one model never wait for another's."""
        self.leases_granted = 0
        """Leases granted so far."""
        self.leases_expired = 0
        """Leases a cut gave up waiting for."""
        self.cuts_spent = 0
        """Versions spent by cuts that produced no export."""
        self.version = version
        """The export version the shards were last together at: restored
        at start or by a cluster restore, or the last version written."""
        self.restored = version
        """The export version the shards' state was loaded from under this
        epoch (0: they started empty). Workers check its offsets against the
        group's commits: what the group committed past them is not in the
        model (`consumers.resume.uncovered`)."""
        self._refusal: PSError | None = None

    # -- sync barriers -------------------------------------------------------
    def barrier(self, model: str | None = None) -> SyncBarrier:
        """The sync barrier of `model` (None: the default model's), made at
        its first use."""
        name = self.model if model is None else model
        barrier = self.barriers.get(name)
        if barrier is None:
            if len(self.barriers) >= MAX_BARRIERS:
                raise InvalidRequestError(f"sync barriers of {MAX_BARRIERS} models exist already: not one for {name}")
            barrier = self.barriers[name] = SyncBarrier(self.sync_max_deadline_s)
        return barrier

    def leave_barrier(self, member: str, model: str | None = None) -> int:
        """`member` leaves `model`'s barrier; returns its open step (0 for a
        model with no barrier: leaving makes none, so a leave naming any
        model cannot fill the coordinator with barriers)."""
        barrier = self.barriers.get(self.model if model is None else model)
        if barrier is None:
            return 0
        barrier.leave(member)
        return barrier.step

    def sync_stats(self) -> dict[str, Any]:
        """JSON-ready: steps closed, shrinks and drops over every model's
        barrier, and each barrier's own (`SyncBarrier.stats`) by model."""
        models = {name: b.stats() for name, b in sorted(self.barriers.items())}
        dropped: dict[str, int] = {}
        for b in self.barriers.values():
            for member, times in b.dropped.items():
                dropped[member] = dropped.get(member, 0) + times
        return {
            "steps_closed": sum(b.steps_closed for b in self.barriers.values()),
            "shrinks": sum(b.shrinks for b in self.barriers.values()),
            "members": sorted({m for b in self.barriers.values() for m in b.members}),
            "dropped": dropped,
            "models": models,
        }

    # -- leases --------------------------------------------------------------
    async def acquire(self, worker: str, wait_s: float | None = None, ttl_s: float | None = None) -> Lease:
        """A lease for one window, living `ttl_s` (at most, and by default,
        `lease_ttl_s`) unless renewed (`renew`); waits while a cut is pausing
        (at most `wait_s`, then `CutInProgressError` saying what the cut
        waits for). While the cluster is not ready (`refuse`), the refusal is
        raised at once."""
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        if self._refusal is not None:
            raise self._refusal
        if not self._open.is_set():
            try:
                await within(self._open.wait(), wait_s)
            except TimeoutError:
                raise CutInProgressError(f"no lease within {wait_s:g}s: {self.cut_waits_for()}") from None
            if self._refusal is not None:
                raise self._refusal
        ttl = self.lease_ttl_s if ttl_s is None else min(ttl_s, self.lease_ttl_s)
        now = time.monotonic()
        lease = Lease(next(self._ids), worker, now + ttl, self.epoch, ttl, now)
        self._active[lease.lease_id] = lease
        self.leases_granted += 1
        return lease

    def renew(self, lease_id: int) -> bool:
        """Extend an active lease by its time to live from now (its holder is
        alive and its window still training); False when it had expired (a
        cut dropped it) and `LeaseError` for an id never granted."""
        lease = self._active.get(lease_id)
        if lease is None:
            if 1 <= lease_id < self._peek_next_id():
                return False
            raise LeaseError(f"lease {lease_id} was never granted")
        self._active[lease_id] = dataclasses.replace(lease, expires_at=time.monotonic() + lease.ttl_s)
        return True

    def cut_waits_for(self) -> str:
        """What a cut in progress waits for, in words: the oldest lease it
        waits for (its worker, how long it has been held, when it ends
        unless renewed), or the shards' copies once no lease is active."""
        if self._open.is_set():
            return "no cut is in progress"
        if not self._active:
            return "a cut is copying the shards' rows"
        now = time.monotonic()
        oldest = self.held()[0]
        others = len(self._active) - 1
        return (
            f"a cut waits for the lease worker {oldest.worker} holds since {now - oldest.granted_at:.0f}s "
            f"(it ends in {max(0.0, oldest.expires_at - now):.0f}s unless renewed)"
            + (f" and {others} other lease{'s' if others > 1 else ''}" if others else "")
        )

    async def release(
        self,
        lease_id: int,
        offsets: Mapping[str, Mapping[int, int]] | None = None,
        stream: StreamIdentity | None = None,
        model: str | None = None,
        also: Sequence[str] = (),
    ) -> bool:
        """End a lease, recording the offsets its window committed, read from
        `stream`, as `model`'s (None: the default model's) and as those of
        each model in `also` (trained on the same window by the same worker).

        Returns False when the lease had expired (a cut may hold part of its
        window): the offsets are still recorded, since they were committed.
        Offsets of a stream other than the recorded one (another Kafka
        cluster, or group) replace every offset held: those of the old
        stream mean nothing in the new one, so a later cut records the new
        stream's offsets only.
        """
        lease = self._active.pop(lease_id, None)
        for name in dict.fromkeys([model or self.model, *also]):
            self._books.setdefault(name, OffsetBook()).record(offsets, stream, name)
        async with self._changed:
            self._changed.notify_all()
        if lease is None:
            if lease_id >= 1 and lease_id < self._peek_next_id():
                return False
            raise LeaseError(f"lease {lease_id} was never granted")
        return True

    def _peek_next_id(self) -> int:
        # itertools.count has no peek: granted ids are 1..leases_granted.
        return self.leases_granted + 1

    def held(self) -> list[Lease]:
        """The leases granted and not yet released or dropped, oldest first."""
        return sorted(self._active.values(), key=lambda lease: lease.granted_at)

    @property
    def active_leases(self) -> int:
        """Leases granted and not yet released or expired."""
        return len(self._active)

    def offsets(self, model: str | None = None) -> Offsets:
        """The latest committed offsets of `model` (None: the default one)
        reported with released leases."""
        book = self._books.get(model or self.model)
        return book.copy() if book is not None else {}

    def stream_of(self, model: str | None = None) -> StreamIdentity | None:
        """The stream `model`'s offsets were read from (None: not known)."""
        book = self._books.get(model or self.model)
        return book.stream if book is not None else None

    @property
    def stream(self) -> StreamIdentity | None:
        """The stream the default model's offsets were read from (None: not known)."""
        return self.stream_of()

    @property
    def stream_changes(self) -> int:
        """Times workers reported a stream other than the one a model's offsets were read from."""
        return sum(b.stream_changes for b in self._books.values())

    def books(self) -> dict[str, tuple[Offsets, StreamIdentity | None]]:
        """Every model's offsets and stream."""
        return {n: (b.copy(), b.stream) for n, b in self._books.items()}

    def set_default(self, model: str) -> None:
        """Make `model` the default model, its offsets those held as the
        default's so far (the exporter names the default model; a
        coordinator built without a name calls it ``ctr``)."""
        if model == self.model:
            return
        book = self._books.pop(self.model)
        self._books.setdefault(model, book)
        self.model = model

    def forget(self, model: str) -> None:
        """Drop a deleted model's offsets (the default model's are kept)."""
        if model != self.model:
            self._books.pop(model, None)

    # -- cuts ----------------------------------------------------------------
    def next_kind(self) -> str:
        """``base`` for the first cut and every `base_every`-th, else ``delta``."""
        if self.last_base == 0 or self.last_version - self.last_base + 1 >= self.base_every:
            return "base"
        return "delta"

    async def cut(self, snapshot: Callable[[int, str], Awaitable[T]], kind: str | None = None) -> Cut[T]:
        """Take a consistent cut; `snapshot(version, kind)` copies the shards' rows.

        Cuts run one at a time. If the snapshot step fails, leases reopen,
        the version is spent (never handed out again: shards that did copy
        may still hold it, and their tables moved on past it) and the next
        cut is a base. Undoing the shards' copies is the caller's (the
        exporter aborts the cut on every shard).
        """
        if kind not in (None, "base", "delta"):
            raise ValueError(f"kind {kind!r} is not base or delta")
        async with self._cut_lock:
            if self._refusal is not None:
                raise ClusterNotReadyError(f"no cut while the cluster is not ready: {self._refusal.detail}")
            kind = kind or self.next_kind()
            if self.last_version == 0 or self.last_base == 0:
                kind = "base"  # a delta needs a parent, and a spent cut broke the chain
            t0 = time.perf_counter()
            self._open.clear()
            version = 0
            try:
                expired = await self._drain()
                t_drained = time.perf_counter()
                version = self.last_version + 1
                snap = await snapshot(version, kind)
                books = self.books()
            except BaseException:
                if version:
                    self.spend(version)
                raise
            finally:
                self._open.set()
            t_done = time.perf_counter()
            parent = self.last_version or None
            self.last_version = version
            if kind == "base":
                self.last_base = version
            return Cut(
                version=version,
                parent=None if kind == "base" else parent,
                kind=kind,
                offsets=books[self.model][0],
                snapshot=snap,
                lease_wait_s=t_drained - t0,
                pause_s=t_done - t0,
                expired_leases=expired,
                stream=books[self.model][1],
                books=books,
            )

    # -- the cluster's version ---------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether leases are granted (no `refuse` standing)."""
        return self._refusal is None

    @property
    def refusal(self) -> PSError | None:
        """Why leases are refused, if they are."""
        return self._refusal

    def refuse(self, error: PSError | None) -> None:
        """Refuse leases and cuts with `error` (retriable `ClusterNotReadyError`
        while shards join or restore; `NoCommonVersionError` when they cannot
        agree), or grant them again with None."""
        self._refusal = error

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[list[str]]:
        """Hold the cut lock with leases closed and none active (as a cut's
        pause); yields the workers whose leases expired meanwhile."""
        async with self._cut_lock:
            self._open.clear()
            try:
                yield await self._drain()
            finally:
                self._open.set()

    def reset(
        self,
        version: int,
        offsets: Mapping[str, Mapping[int, int]],
        stream: StreamIdentity | None = None,
        books: Mapping[str, tuple[Mapping[str, Mapping[int, int]], StreamIdentity | None]] | None = None,
    ) -> None:
        """Every shard now holds export `version`: resume from its offsets
        (the default model's `offsets`, read from `stream`; other models'
        in `books`) under a new epoch (workers drop what they buffered and
        seek there), and make the next cut a base."""
        self._books = {n: OffsetBook(o, st) for n, (o, st) in (books or {}).items()}
        self._books[self.model] = OffsetBook(offsets, stream)
        self.version = version
        self.restored = version
        self.last_base = 0
        self.epoch = secrets.token_hex(8)

    def spend(self, version: int) -> None:
        """Mark `version` used by a cut that produced no export (its snapshot
        or its write failed): it is never handed out again, and the next cut
        is a base, since shards that copied moved their tables on past it."""
        self.last_version = max(self.last_version, version)
        self.last_base = 0
        self.cuts_spent += 1

    async def _drain(self) -> list[str]:
        """Wait until no lease is active; leases past their expiry are dropped."""
        expired: list[str] = []
        async with self._changed:
            while self._active:
                now = time.monotonic()
                for lease in [l for l in self._active.values() if l.expires_at <= now]:
                    del self._active[lease.lease_id]
                    expired.append(lease.worker)
                    self.leases_expired += 1
                if not self._active:
                    break
                soonest = min(l.expires_at for l in self._active.values())
                try:
                    await within(self._changed.wait(), max(0.0, soonest - now))
                except TimeoutError:
                    pass  # the soonest lease has expired: the loop drops it
        return expired
