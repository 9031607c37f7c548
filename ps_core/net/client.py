"""The data plane's client: ``await pull(table, keys)``, ``await push(table, keys, grads)``.

`PSReader` routes each key with `shard_of`, sends one request per shard
concurrently, and reassembles the answers in the caller's order; `PSClient`
adds pushes. They reach shards through transports (`ps_core.net.transports`):
`TcpTransport` (the shard's TCP RPC: the default of `PSClient.connect`),
`HttpTransport` (the same frames over aiohttp) or `LocalTransport` (a `Shard`
object in this process: the demo and tests). All behave the same.

Credentials and TLS: `PSClient.connect(urls, token=..., ssl=...)` presents
the token (`ps_core.net.auth`) on every HTTP request and in the RPC's hello, and
verifies ``https://`` shards (and their RPC, then TLS too) with the client
context `ssl`. A refused token raises `AuthError` (401) or `ForbiddenError`
(403), a server certificate that does not verify `TlsVerifyError`: neither
is retried, since waiting does not fix a configuration.

Every push carries a request id; a shard acknowledges a retried id without
applying it twice, so retrying after a lost ack is safe.

`push_pull` sends one mini-batch's push and the next one's pull in one request
per shard (the shard applies the push, then answers the pull), halving a
training loop's requests.

Tables, stats, the status board, leases and exports are the control plane's
(`ps_core.checkpoint.control.ControlClient`).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import ssl as ssl_
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np
import numpy.typing as npt

from ..errors import MovedError, PSError, SlotsUnsettledError
from ..hashing import U64
from ..rows import put_rows
from ..shard import Shard
from ..slots import SlotMap
from ..store.change_log import Changes
from ..store.storage import F32
from .endpoint import RetryPolicy, ShardGroup
from .routing import split_by_shard
from .transports import HttpTransport, LocalTransport, Pulled, Push, ShardReader, ShardTransport, TcpTransport
from .wire import F32_WIRE, WireFormat, WireStats

__all__ = ["PSReader", "PSClient", "Routed", "Settling", "SlotSource", "fan_out"]

SlotSource = Callable[[], Awaitable[SlotMap]]
"""Where a client reads the cluster's current slot map (the coordinator's)."""

SETTLE_S = 10.0
"""How long a call waits, after a shard answered `moved`, for the shards'
maps and its own to agree (a move's steps take milliseconds)."""


@dataclass
class Settling:
    """One call's waits for the slot maps to settle (`PSReader.refresh_slots`)."""

    deadline: float
    tries: int = 0


T = TypeVar("T", bound=ShardReader)
T_ = TypeVar("T_")


@dataclass(frozen=True)
class Routed:
    """Keys split by shard (`PSClient.route`), reusable for a pull and a push."""

    keys: U64
    """The keys, in the caller's order."""
    order: npt.NDArray[np.intp] | None
    """Permutation grouping the keys by shard (None with one shard)."""
    parts: list[slice]
    """Each shard's slice of the grouped keys."""
    by_shard: U64
    """The keys grouped by shard (``keys[order]``)."""
    clocks: dict[str, list[int]] = field(default_factory=dict)
    """Per table, each shard's clock when a `PSClient` pulled these keys: the
    push of gradients computed from that pull carries it back, and the
    shard counts how stale they were (`ps_core.store.staleness`)."""
    key_sets: dict[str, int] = field(default_factory=dict)
    """Per table, the id under which the shards remembered these keys when a
    `PSClient` whose transports keep key sets pulled them: the push that
    follows names the set instead of sending the keys (`ps_core.shard.key_sets`)."""
    epoch: int = 1
    """The epoch of the slot map that split them."""


class PSReader(ShardGroup[T]):
    """Pull whole key batches across all shards: what serving needs.

    A reader over `ShardReader`s has no write path at all (a serving
    replica's); `PSClient` is a reader that also pushes.
    """

    def __init__(self, transports: Sequence[T], *, session: aiohttp.ClientSession | None = None) -> None:
        super().__init__(transports, session=session)
        self.transports = self._members
        """Shard i's transport at place i."""
        self.slot_map = SlotMap.even(self.num_shards)
        """The slot map keys are routed by (`ps_core.slots`): the even map of
        the shard count until a newer one is given (`use_slot_map`)."""
        self.slot_source: SlotSource | None = None
        """Where a newer map is read when a shard answers `moved` (None: the
        `MovedError` is raised to the caller)."""
        self.reroutes = 0
        """Calls sent again by a newer slot map after a shard answered `moved`."""
        self.settle_waits = 0
        """Waits for the maps to settle during a move (`refresh_slots`)."""
        self.settle_s = SETTLE_S
        """How long one call waits for them, from its first refusal."""

    def use_slot_map(self, slot_map: SlotMap) -> bool:
        """Route by `slot_map` from now on if it is newer than the map held
        (a higher epoch); True when taken. `ValueError` for a map of another
        shard count than the client's."""
        if slot_map.num_shards != self.num_shards:
            raise ValueError(f"a slot map of {slot_map.num_shards} shards for a client of {self.num_shards}")
        if slot_map.epoch <= self.slot_map.epoch:
            return False
        self.slot_map = slot_map
        return True

    def _current(self, keys: npt.ArrayLike | Routed) -> Routed:
        """`keys` split by the map held: a route kept from an older map is
        split again (the shards would refuse some of it, and one in this
        process would trust it)."""
        if isinstance(keys, Routed) and keys.epoch == self.slot_map.epoch:
            return keys
        return self.route(keys.keys if isinstance(keys, Routed) else keys)

    async def refresh_slots(self, moved: MovedError, settling: Settling, routed_by: int) -> None:
        """After a shard answered `moved` to keys split by the map of epoch
        `routed_by`: return when sending them again is worth it, else raise
        `moved`. A route kept from an older map is split by the map held; a
        shard with a newer map sends the client to its `slot_source`; a
        shard with an older one (a move's destination, about to take its
        slots) or a source behind the shard is waited for, backing off, until
        `settle_s` from the first refusal, then `SlotsUnsettledError` (an
        outage its caller waits out: a move cut short). A shard that refuses at the
        client's own epoch disagrees on something else (its shard count):
        raised at once, as is any refusal without a `slot_source`."""
        if routed_by < self.slot_map.epoch:
            self.reroutes += 1
            return  # a route kept from before this client took a newer map
        if self.slot_source is None or moved.epoch == self.slot_map.epoch:
            raise moved
        source = await self.slot_source()
        if self.use_slot_map(source) or (moved.epoch < self.slot_map.epoch and source.epoch == moved.epoch):
            # A newer map; or the cluster went back to an older one (restored
            # from a cut taken before slots moved), which its shards agree on.
            self.slot_map = source
            self.reroutes += 1
            return
        # The maps are settling (a move between its steps): wait, then send again.
        wait = min(0.005 * 2 ** min(settling.tries, 7), 0.5)
        if time.monotonic() + wait > settling.deadline:
            raise SlotsUnsettledError(
                f"the slot maps did not agree within {self.settle_s:g} s: a shard refused keys at epoch "
                f"{moved.epoch}, this client routes by epoch {self.slot_map.epoch} and shard 0 answers "
                f"epoch {source.epoch} ({moved.detail})"
            ) from moved
        settling.tries += 1
        self.settle_waits += 1
        await asyncio.sleep(wait)

    # -- routing -------------------------------------------------------------
    def route(self, keys: npt.ArrayLike) -> Routed:
        """Split `keys` by shard once, for a pull and a push of the same keys."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        order, bounds = split_by_shard(k, self.slot_map)
        parts = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(self.num_shards)]
        return Routed(k, order, parts, k if order is None else k[order], epoch=self.slot_map.epoch)

    async def pull(self, table: str, keys: npt.ArrayLike | Routed) -> F32:
        """Weights (n, dim) of `keys` (or a `route` of them), in their order."""
        r = self._current(keys)
        settling = Settling(time.monotonic() + self.settle_s)
        while True:
            jobs = _pull_jobs(r)
            try:
                results = await fan_out([self.transports[i].pull(table, r.by_shard[p]) for i, p in jobs])
            except MovedError as moved:  # a pull changes nothing: asked again whole, by the newer map
                await self.refresh_slots(moved, settling, r.epoch)
                r = self.route(r.keys)
                continue
            return _reassemble(r, results)

    async def pull_versioned(self, table: str, keys: npt.ArrayLike | Routed, *, presence: bool = False) -> Pulled:
        """Like `pull`, with the table's open version and, with `presence`,
        whether each key has a row (an index lookup on the shard, no insert)."""
        r = self._current(keys)
        settling = Settling(time.monotonic() + self.settle_s)
        while True:
            jobs = _pull_jobs(r)
            try:
                results: list[Pulled] = await fan_out(
                    [self.transports[i].pull_versioned(table, r.by_shard[p], presence) for i, p in jobs]
                )
                break
            except MovedError as moved:
                await self.refresh_slots(moved, settling, r.epoch)
                r = self.route(r.keys)
        present = None
        if presence:
            present = _reassemble(r, [x.present for x in results if x.present is not None])
        return Pulled(
            _reassemble(r, [x.weights for x in results]),
            min(x.version for x in results),
            present,
        )


class PSClient(PSReader[ShardTransport]):
    """Pull and push whole key batches across all shards.

    Use ``async with PSClient.connect(urls) as client`` for shard servers or
    ``PSClient.local(shards)`` for shards in this process.
    """

    def __init__(
        self,
        transports: Sequence[ShardTransport],
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        super().__init__(transports, session=session)
        # A random base keeps request ids of different clients apart.
        self._request_ids = itertools.count(secrets.randbits(62) + 1)
        self._key_sets = any(t.key_sets for t in transports)

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        connections_per_shard: int = 16,
        rpc: bool = True,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
        wire: WireFormat = F32_WIRE,
    ) -> PSClient:
        """A client for shard servers at `urls` (shard i at urls[i]).

        With `rpc` (the default), pulls and pushes go over a shard's TCP RPC
        when it offers one (`TcpTransport`); without, everything is HTTP
        through an aiohttp pool of `connections_per_shard` per shard.
        `token` is presented to every shard (`ps_core.net.auth`; "" for none);
        `ssl`, a client context (`ps_core.net.tls.client_context`), verifies
        ``https://`` shards and their RPC. `wire` is how pulls and pushes
        travel (`ps_core.net.wire`: value types, key sets).
        Must be called with an event loop running (it opens a connection pool).
        """
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=connections_per_shard, limit=0),
            skip_auto_headers=("User-Agent",),
        )
        policy = retry or RetryPolicy()
        kind = TcpTransport if rpc else HttpTransport
        transports = [kind(i, u, session, policy, token=token, ssl=ssl, wire=wire) for i, u in enumerate(urls)]
        return cls(transports, session=session)

    @classmethod
    def local(cls, shards: Sequence[Shard]) -> PSClient:
        """A client over shards in this process.

        Where shard i's spec is ``ShardSpec(i, len(shards))`` and the
        client's slot map is the shard's, the client's routing is the shard's
        ownership, and the shard does not check it again; a shard placed or counted otherwise checks every key (and
        refuses those it does not own, as a shard server would)."""
        n = len(shards)
        transports = [LocalTransport(s) for s in shards]
        client = cls(transports)
        for i, (s, t) in enumerate(zip(shards, transports)):
            if (s.spec.shard_id, s.spec.num_shards) == (i, n):
                t.routed_by = client
        return client

    async def pull(self, table: str, keys: npt.ArrayLike | Routed, *, for_push: bool = True) -> F32:
        """Weights (n, dim) of `keys` (or a `route` of them), in their order.
        A `Routed` keeps each shard's table clock, for the push of the
        gradients computed from these weights, and (`for_push`, with
        transports that keep key sets) the id of the key set the shards
        remembered, which that push names instead of sending the keys."""
        if not isinstance(keys, Routed):
            return await super().pull(table, keys)
        r = self._current(keys)
        settling = Settling(time.monotonic() + self.settle_s)
        while True:
            jobs = _pull_jobs(r)
            remember = self.new_request_id() if self._key_sets and for_push else 0
            try:
                results: list[Pulled] = await fan_out(
                    [self.transports[i].pull_versioned(table, r.by_shard[p], False, remember) for i, p in jobs]
                )
                break
            except MovedError as moved:
                # Asked again by the newer map; the caller's route is left as
                # it was, so the push that follows finds the move itself.
                await self.refresh_slots(moved, settling, r.epoch)
                r = self.route(r.keys)
        if r is not keys:
            return _reassemble(r, [x.weights for x in results])
        _mark_remembered(r, table, remember)
        clocks = [0] * self.num_shards
        for (i, _), x in zip(jobs, results):
            clocks[i] = x.clock
        r.clocks[table] = clocks
        return _reassemble(r, [x.weights for x in results])

    async def push(
        self,
        table: str,
        keys: npt.ArrayLike | Routed,
        grads: npt.ArrayLike,
        *,
        counts: npt.ArrayLike | None = None,
        event_time: float = 0.0,
        request_id: int | None = None,
    ) -> int:
        """Apply gradients (n, dim) of `keys`; returns distinct keys applied.

        `counts` (n, 2) adds shows and clicks; `event_time` sets ``last_seen``.
        Returns when every shard involved has acknowledged. A push spanning
        several shards is not atomic: if one shard fails, the others keep their
        part. To retry such a push safely, pass the same `request_id` again
        (see `new_request_id`); shards that applied it acknowledge without
        applying twice.
        """
        r = self._current(keys)
        k, g, c = _push_arrays(r, grads, counts)
        if k.size == 0:
            return 0
        rid = self.new_request_id() if request_id is None else request_id
        base = r.clocks.get(table) or [0] * self.num_shards
        ref = r.key_sets.pop(table, 0)  # a set is used once
        jobs = [(i, p) for i, p in enumerate(r.parts) if p.stop > p.start]
        results = await fan_out(
            [
                _unless_moved(
                    self.transports[i].push(
                        Push(table, k[p], g[p], None if c is None else c[p], event_time, rid, base[i], ref)
                    )
                )
                for i, p in jobs
            ]
        )
        applied = sum(x for x in results if isinstance(x, int))
        refused = [(p, x) for (_, p), x in zip(jobs, results) if isinstance(x, MovedError)]
        if refused:
            applied += await self._push_moved(table, k, g, c, refused, event_time, r.epoch)
        return applied

    async def _push_moved(
        self,
        table: str,
        k: U64,
        g: F32,
        c: F32 | None,
        refused: list[tuple[slice, MovedError]],
        event_time: float,
        routed_by: int,
    ) -> int:
        """Push again, by a newer slot map, the parts of a push that shards
        refused as `moved` (nothing of them was applied). They go under a new
        request id: the shard that owns them now may have applied its own
        part of the push under the first one. (A caller that then retries
        the whole push with the first id may apply them twice: moves, which
        change maps, are to carry what a slot's pushes were.)"""
        total = 0
        settling = Settling(time.monotonic() + self.settle_s)
        while refused:
            await self.refresh_slots(refused[0][1], settling, routed_by)
            sel = np.concatenate([np.arange(p.start, p.stop) for p, _ in refused])
            k, g = k[sel], g[sel]
            c = None if c is None else c[sel]
            r = self.route(k)
            routed_by = r.epoch
            k, g, c = _push_arrays(r, g, c)
            rid = self.new_request_id()
            jobs = [(i, p) for i, p in enumerate(r.parts) if p.stop > p.start]
            results = await fan_out(
                [
                    _unless_moved(
                        self.transports[i].push(
                            Push(table, k[p], g[p], None if c is None else c[p], event_time, rid, 0, 0)
                        )
                    )
                    for i, p in jobs
                ]
            )
            total += sum(x for x in results if isinstance(x, int))
            refused = [(p, x) for (_, p), x in zip(jobs, results) if isinstance(x, MovedError)]
        return total

    async def push_pull(
        self,
        table: str,
        push_keys: npt.ArrayLike | Routed,
        grads: npt.ArrayLike,
        *,
        pull_keys: npt.ArrayLike | Routed,
        counts: npt.ArrayLike | None = None,
        event_time: float = 0.0,
        request_id: int | None = None,
    ) -> tuple[int, F32]:
        """Push gradients of `push_keys`, then pull `pull_keys`, in one
        request per shard; returns (distinct keys applied, weights (m, dim) of
        `pull_keys` in their order).

        The same as ``await push(table, push_keys, grads, ...)`` then ``await
        pull(table, pull_keys)``: each shard applies its part of the push
        before answering its part of the pull, so the pull sees the push. In a
        training loop, push mini-batch i and pull mini-batch i+1 (each a
        `route`); either may be empty. A shard with only a push part or only a
        pull part still gets one request. Requests are retried with their
        request id, as a push's are; like a push, it is not atomic across
        shards: pass the same `request_id` again to retry it whole.
        """
        pr = self._current(push_keys)
        qr = pr if pull_keys is push_keys else self._current(pull_keys)
        for name, r in (("push_keys", pr), ("pull_keys", qr)):
            if len(r.parts) != self.num_shards:
                raise ValueError(f"{name} were routed for {len(r.parts)} shards, this client has {self.num_shards}")
        k, g, c = _push_arrays(pr, grads, counts)
        rid = self.new_request_id() if request_id is None else request_id
        base = pr.clocks.get(table) or [0] * self.num_shards
        ref = pr.key_sets.pop(table, 0)
        # The pull is remembered under this request's id, for the next push.
        remember = rid if self._key_sets and pr is not qr else 0
        jobs = [i for i, (p, q) in enumerate(zip(pr.parts, qr.parts)) if p.stop > p.start or q.stop > q.start] or [0]
        # Nothing at all to send still asks shard 0, which answers with the
        # table's dim (and an unknown table's error), as an empty pull does.
        pushes = [
            Push(
                table,
                k[pr.parts[i]],
                g[pr.parts[i]],
                None if c is None else c[pr.parts[i]],
                event_time,
                rid,
                base[i],
                ref,
            )
            for i in jobs
        ]
        # Pulling the very keys pushed: the same array, which the frame
        # then names by a flag instead of carrying the keys twice.
        answers = await fan_out(
            [
                _unless_moved(
                    self.transports[i].push_pull(push, push.keys if pr is qr else qr.by_shard[qr.parts[i]], remember)
                )
                for i, push in zip(jobs, pushes)
            ]
        )
        refused = [(pr.parts[i], x) for i, x in zip(jobs, answers) if isinstance(x, MovedError)]
        if refused:
            # The refusing shards applied none of their push: it goes again by
            # a newer map, then the pull is asked again whole (it sees it).
            applied = sum(x[0] for x in answers if not isinstance(x, MovedError))
            pushed = [(p, x) for p, x in refused if p.stop > p.start]
            applied += await self._push_moved(table, k, g, c, pushed, event_time, pr.epoch)
            return applied, await self.pull(table, qr.keys)
        results: list[tuple[int, F32, int]] = [x for x in answers if not isinstance(x, MovedError)]
        clocks = [0] * self.num_shards
        for i, (_, _, clock) in zip(jobs, results):
            clocks[i] = clock
        qr.clocks[table] = clocks
        _mark_remembered(qr, table, remember)
        # Every reply's weights have the table's dim, empty or not, so all
        # concatenate (in shard order) into the pull's grouped order.
        return sum(a for a, _, _ in results), _reassemble(qr, [w for _, w, _ in results])

    async def changes(self, table: str, cursors: Sequence[tuple[int, int]], own: Sequence[int]) -> list[Changes]:
        """Each shard's answer for geo table `table`: the keys changed after
        ``cursors[i]`` (shard i's change log incarnation and sequence number
        of an earlier answer; (0, 0) for none) by pushes other than those
        with request ids `own` (`ps_core.store.change_log`)."""
        ids = np.asarray(own, dtype=np.uint64)
        return list(
            await fan_out(
                [t.changes(table, since, incarnation, ids) for t, (incarnation, since) in zip(self.transports, cursors)]
            )
        )

    def new_request_id(self) -> int:
        """A fresh push id, unique to this client."""
        return next(self._request_ids)

    def wire_stats(self) -> WireStats:
        """What this client's frames cost, summed over its shards (zero for
        shards in this process)."""
        total = WireStats()
        for t in self.transports:
            stats = getattr(t, "wire_stats", None)
            if isinstance(stats, WireStats):
                total.add(stats)
        return total


async def _unless_moved(call: Awaitable[T_]) -> T_ | MovedError:
    """`call`'s answer, or the `MovedError` it raised: a shard's refusal of
    keys it does not own, answered without cancelling the other shards' parts."""
    try:
        return await call
    except MovedError as moved:
        return moved


def _mark_remembered(r: Routed, table: str, set_id: int) -> None:
    """Note that the shards keep `r`'s keys of `table` under `set_id` (0: not kept)."""
    if set_id:
        r.key_sets[table] = set_id
    else:
        r.key_sets.pop(table, None)


def _push_arrays(r: Routed, grads: npt.ArrayLike, counts: npt.ArrayLike | None) -> tuple[U64, F32, F32 | None]:
    """A push's keys, gradients (n, dim) and counts (n, 2), checked against
    the keys and grouped by shard like ``r.by_shard``."""
    k = r.keys
    g = np.asarray(grads, dtype=np.float32)
    if g.ndim == 1:
        g = g.reshape(-1, 1)
    c = None if counts is None else np.asarray(counts, dtype=np.float32).reshape(-1, 2)
    if g.shape[0] != k.size:
        raise ValueError(f"{k.size} keys but {g.shape[0]} gradient rows")
    if c is not None and c.shape[0] != k.size:
        raise ValueError(f"{k.size} keys but {c.shape[0]} rows of counts")
    if r.order is not None and k.size:
        k, g = r.by_shard, g.take(r.order, axis=0)  # take: `ps_core.rows`
        c = None if c is None else c.take(r.order, axis=0)
    return k, g, c


def _pull_jobs(r: Routed) -> list[tuple[int, slice]]:
    """The shards a pull asks, with their slices of ``r.by_shard``.

    An empty batch still asks shard 0, which answers with the table's dim."""
    return [(i, p) for i, p in enumerate(r.parts) if p.stop > p.start or (i == 0 and r.keys.size == 0)]


def _reassemble(r: Routed, parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """Per-shard answers (in shard order) back in the order of ``r.keys``."""
    got = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if r.order is None:
        # A reply frame is a read-only view of the received bytes.
        return got if got.flags.writeable else got.copy()
    out = np.empty_like(got)
    if got.ndim == 2:
        put_rows(out, r.order, got)
    else:
        out[r.order] = got
    return out


async def fan_out(coros: Sequence[Any]) -> list[Any]:
    """Run coroutines concurrently; on the first failure cancel the rest and
    raise that failure itself (not an ExceptionGroup)."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        for exc in group.exceptions:
            if isinstance(exc, PSError):
                raise exc from None
        raise first from None
    return [t.result() for t in tasks]
