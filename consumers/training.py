"""How a window's events train the model, one class per update mode.

A worker hands each window's decoded pieces to its `Training`, which cuts
them into mini-batches, predicts every event before learning from it
(progressive validation) and updates the shards as its mode says
(docs/architecture.md, "Update modes"):

- `AsyncTraining`: pull → predict → gradients → push, each push applied as
  it arrives; a mini-batch's push and the pull of the one `in_flight`
  mini-batches later share a request (1: the next one's);
- `SyncTraining`: the same, but the shards hold each step's gradients until
  every worker of the model inside a window has pushed (its model's
  barrier, `ps_core.checkpoint.barrier`);
- `GeoTraining`: a local copy trained (`ps_core.model.geo.GeoCopy`), its
  differences pushed every `geo_steps` mini-batches and at the window's end.

Each returns the window's progressive metrics; all of a window's updates are
acknowledged before it returns, so the worker's commit covers them.

An event whose gradients are not finite (which the shards would refuse for
the whole push) is left out of its mini-batch and listed in
`Training.untrainable`, for the worker to dead-letter; validation's bounds
(`ps_core.model.events.MAX_WEIGHT`, `MAX_VALUE`) leave only a model's own
extreme weights to cause one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from ps_core.checkpoint.control import ControlClient
from ps_core.errors import InvalidValuesError, PSError
from ps_core.model.batch import F32, F64, I64, EventBatch
from ps_core.model.events import MAX_TS
from ps_core.model.geo import GeoCopy
from ps_core.model.metrics import Metrics, evaluate
from ps_core.model.models import BatchPlan, Model, sigmoid
from ps_core.model.ramp import DEFAULT_RAMP, MiniBatchRamp
from ps_core.net.change_feed import ChangeFeed
from ps_core.net.client import PSClient, Routed

from .windows import Window

__all__ = [
    "Training",
    "AsyncTraining",
    "in_flight_cap",
    "SyncTraining",
    "GeoTraining",
    "TrainingStats",
    "mini_batches",
    "per_table",
]

_T = TypeVar("_T")
log = logging.getLogger("ctrps.worker")


class TrainingStats(Protocol):
    """The running totals a training updates (a worker's `WorkerStats`)."""

    events_trained: int
    sync_steps: int
    geo_rounds: int
    geo_full_refreshes: int


async def per_table(calls: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """The results of one call per table, concurrently. A model of one table
    (LR) awaits its call directly: `asyncio.gather` would wrap it in a task
    and a loop round trip on every training step."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


async def mini_batches(
    pieces: AsyncIterator[EventBatch], step: int | Callable[[int], int]
) -> AsyncIterator[EventBatch]:
    """Consecutive mini-batches of `step` events of the pieces (or of
    ``step(done)`` events after `done` yielded, never fewer than the one
    before: `MiniBatchRamp.next_size`): a mini-batch takes the end of one
    piece and the start of the next, as if they were one batch (only its few
    events are copied, not the pieces)."""
    size: Callable[[int], int] = step if callable(step) else (lambda _: step)
    done = 0
    want = size(0)
    rest: EventBatch | None = None
    async for batch in pieces:
        start = 0
        if rest is not None:
            start = min(want - rest.size, batch.size)
            rest = EventBatch.concat([rest, batch.slice(0, start)], [0, 0])
            if rest.size < want:
                continue
            yield rest
            done += rest.size
            want = size(done)
            rest = None
        while batch.size - start >= want:  # per mini-batch, not per event
            yield batch.slice(start, start + want)
            start += want
            done += want
            want = size(done)
        if start < batch.size:
            rest = batch.slice(start, batch.size)
    if rest is not None and rest.size:
        yield rest


def _window_time(window: Window) -> float:
    """The window's latest broker timestamp in seconds; 0 (a push's "the
    shard's clock") where the shards would refuse it: a record without one
    (-1), or one not in milliseconds."""
    t = window.last_ts_ms / 1000.0
    return t if 0 <= t < MAX_TS else 0.0


def _event_time(sub: EventBatch, window: Window) -> float:
    """A mini-batch's latest event time (the window's when it has none)."""
    ts = sub.ts[np.isfinite(sub.ts)]
    return float(ts.max()) if ts.size else _window_time(window)


def _finite(grads: dict[str, F32]) -> bool:
    """Every gradient finite, as a shard checks it: a float64 sum of float32
    values is finite exactly when they all are."""
    return all(math.isfinite(g.sum(dtype=np.float64)) for g in grads.values())


def _only(sub: EventBatch, plan: BatchPlan, dlogit: F64, keep: npt.NDArray[np.bool_]) -> tuple[EventBatch, F64]:
    """`sub` and its dLoss/dlogit with the events not kept taking no part:
    their values, weights and dlogit 0 (by `np.where`, so an infinity or NaN
    of theirs is not multiplied into anything), so each model's gradients are
    the sum of the kept events' own (a model's gradient is per event, then
    summed; a mixture's learners weigh each event by its weight)."""
    values = np.where(keep[plan.event_of], sub.values, np.float32(0))
    weights = np.where(keep, sub.weights, np.float32(0))
    return replace(sub, values=values, weights=weights), np.where(keep, dlogit, 0.0)


def _untrainable(model: Model, sub: EventBatch, plan: BatchPlan, weights: dict[str, F32], dlogit: F64) -> I64:
    """The events of `sub` whose own gradients are not finite, found by
    halving: a run of events whose gradients are finite is clear, a single
    event whose are not is untrainable. Only for a mini-batch whose gradients
    are not finite (a few gradient computations per such event)."""
    n = sub.size
    bad: list[int] = []
    runs = [(0, n)]
    while runs:
        lo, hi = runs.pop()
        keep = np.zeros(n, dtype=bool)
        keep[lo:hi] = True
        masked, d = _only(sub, plan, dlogit, keep)
        if _finite(model.gradients(masked, plan, weights, d)):
            continue
        if hi - lo == 1:
            bad.append(lo)
        else:
            mid = (lo + hi) // 2
            runs += [(mid, hi), (lo, mid)]
    return np.array(sorted(bad), dtype=np.int64)


class _Step(NamedTuple):
    """A mini-batch ready to train: its events and everything but the weights."""

    batch: EventBatch
    plan: BatchPlan
    routed: Routed
    event_time: float


class _Progressive:
    """The predictions and labels of a window, in event order."""

    def __init__(self) -> None:
        self.predicted: list[npt.NDArray[np.float64]] = []
        self.labels: list[npt.NDArray[np.float32]] = []
        self.events = 0

    def add(self, p: npt.NDArray[np.float64], labels: npt.NDArray[np.float32]) -> None:
        self.predicted.append(p)
        self.labels.append(labels)
        self.events += int(p.size)

    def metrics(self) -> Metrics:
        if not self.predicted:
            return evaluate(np.empty(0), np.empty(0, dtype=np.float32))
        return evaluate(np.concatenate(self.predicted), np.concatenate(self.labels))


@dataclass(eq=False)
class Training(ABC):
    """A window's training in one update mode (every mode's fields first,
    then the mode's own, keyword-only)."""

    client: PSClient
    model: Model
    stats: TrainingStats
    mini_batch: int
    untrainable: list[tuple[int, str]] = field(default_factory=list, init=False)
    """(event index, why) of each event left out because its gradients were
    not finite, since the caller last cleared it; an event's index is what
    its batch's `EventBatch.index` said (the worker's: its record in the window)."""

    def _mini_batches(self, pieces: AsyncIterator[EventBatch], ramp: int = 0) -> AsyncIterator[EventBatch]:
        """The window's mini-batches: `mini_batch` events each, or ramping
        (`MiniBatchRamp`) from the events this training has learnt so far."""
        sizes, learnt = MiniBatchRamp(self.mini_batch, ramp), self.stats.events_trained
        return mini_batches(pieces, lambda done: sizes.next_size(learnt + done))

    def _learn(
        self, sub: EventBatch, plan: BatchPlan, weights: dict[str, F32], seen: _Progressive
    ) -> tuple[dict[str, F32], F32]:
        """Predict `sub` from `weights` (recorded in `seen`: progressive
        validation), then its gradients and each key's shows and clicks.

        An event whose gradients are not finite takes no part (listed in
        `untrainable`): the shards would refuse the whole push for it.
        `InvalidValuesError` if they are not finite, yet no event's alone is."""
        p = sigmoid(self.model.logits(sub, plan, weights))
        dlogit = (p - sub.labels) * sub.weights
        grads = self.model.gradients(sub, plan, weights, dlogit)
        if _finite(grads):  # one sum per table: the common case
            seen.add(p, sub.labels)
            return grads, plan.counts(sub.labels)
        bad = _untrainable(self.model, sub, plan, weights, dlogit)
        keep = np.ones(sub.size, dtype=bool)
        keep[bad] = False
        masked, d = _only(sub, plan, dlogit, keep)
        grads = self.model.gradients(masked, plan, weights, d)
        if not _finite(grads):
            raise InvalidValuesError(
                f"model {self.model.name}: gradients of a mini-batch of {sub.size} events are not finite, "
                "though each event's own are: its sum overflows float32"
            )
        why = f"model {self.model.name}: its gradients are not finite (from the model's weights for its features)"
        self.untrainable.extend((int(i), why) for i in sub.index[bad].tolist())
        log.warning(
            f"{bad.size} event(s) of a mini-batch left out: gradients not finite, they go to the dead-letter topic",
            extra={"fields": {"model": self.model.name, "events": int(bad.size), "mini_batch": sub.size}},
        )
        seen.add(p[keep], sub.labels[keep])
        return grads, plan.counts(sub.labels, keep)

    @abstractmethod
    async def train(self, pieces: AsyncIterator[EventBatch], window: Window) -> Metrics:
        """Train the events of `pieces`, in order; the window's progressive metrics."""

    def reset(self) -> None:  # noqa: B027 (most modes hold nothing of the shards' state)
        """Forget what this training holds of the shards' state (after a
        window failed part-way, or the shards went back to a cut)."""


def in_flight_cap(model: Model) -> int | None:
    """The most mini-batches an async worker of `model` may have in flight
    (`AsyncTraining.in_flight`) so that its own pushes stay within the
    tightest ``max_staleness`` its tables declare: with D in flight, a push is
    computed from a pull that D - 1 of this worker's pushes follow. None: no
    table bounds staleness."""
    bounds = [t.max_staleness for t in model.tables() if t.max_staleness is not None]
    return min(bounds) + 1 if bounds else None


@dataclass(eq=False, kw_only=True)
class AsyncTraining(Training):
    """Async mode: each push applied as it arrives."""

    ramp: int = DEFAULT_RAMP
    """Mini-batches grow from `RAMP_START` events by one per `ramp` events
    this training has learnt, up to `mini_batch` (`MiniBatchRamp`; 0: none)."""
    in_flight: int = 1
    """Mini-batches in flight at once (D): mini-batch k+D's pull travels with
    mini-batch k's push, so D round trips to the shards overlap. 1: each
    mini-batch waits for the one before it (its pull rides with that push)."""
    depth: int = field(init=False)
    """`in_flight` as used: capped by `in_flight_cap` (a warning says so)."""

    def __post_init__(self) -> None:
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, not {self.in_flight}")
        cap = in_flight_cap(self.model)
        self.depth = self.in_flight if cap is None else min(self.in_flight, cap)
        if cap is not None and self.depth < self.in_flight:
            log.warning(
                f"in-flight {self.in_flight} capped to {self.depth}: model {self.model.name} declares "
                f"max_staleness {cap - 1}, and with N mini-batches in flight this worker's own pushes are N - 1 stale",
                extra={"fields": {"model": self.model.name, "in_flight": self.in_flight, "depth": self.depth}},
            )

    async def train(self, pieces: AsyncIterator[EventBatch], window: Window) -> Metrics:
        """Mini-batches of pull → predict → gradient → push.

        Progressive validation: each event's prediction is made from the
        weights pulled for its mini-batch, before that mini-batch's push, so
        every event is predicted before it is learnt from, by the model as it
        stands at that moment (not as it stood at the window's start; with
        `depth` D > 1, missing at most the D - 1 pushes still in flight).
        """
        seen = _Progressive()

        def planned(sub: EventBatch) -> _Step:
            plan = self.model.plan(sub)
            # Split once for the pull and the push.
            return _Step(sub, plan, self.client.route(plan.keys), _event_time(sub, window))

        batches = self._mini_batches(pieces, self.ramp)
        if self.depth > 1:
            await self._overlapped(batches, planned, seen)
        else:
            await self._in_turn(batches, planned, seen)
        self.stats.events_trained += seen.events
        return seen.metrics()

    async def _pull(self, step: _Step) -> dict[str, F32]:
        names = self.model.table_names
        return dict(zip(names, await per_table([self.client.pull(t, step.routed) for t in names])))

    async def _push(self, step: _Step, grads: dict[str, F32], counts: F32) -> None:
        await per_table(
            [
                self.client.push(t, step.routed, grads[t], counts=counts, event_time=step.event_time)
                for t in self.model.table_names
            ]
        )

    async def _push_pull(self, step: _Step, grads: dict[str, F32], counts: F32, pull: _Step) -> dict[str, F32]:
        """`step`'s push and `pull`'s pull in one request per shard; each
        shard applies the push before reading the pull."""
        names = self.model.table_names
        got = await per_table(
            [
                self.client.push_pull(
                    t, step.routed, grads[t], pull_keys=pull.routed, counts=counts, event_time=step.event_time
                )
                for t in names
            ]
        )
        return {t: w for t, (_, w) in zip(names, got)}

    async def _in_turn(
        self, batches: AsyncIterator[EventBatch], planned: Callable[[EventBatch], _Step], seen: _Progressive
    ) -> None:
        """One mini-batch at a time: each waits for the one before it."""
        first = await anext(batches, None)
        if first is None:
            return
        # Planned one mini-batch ahead: the next one's keys go with this push.
        current = planned(first)
        weights = await self._pull(current)
        while True:
            grads, counts = self._learn(current.batch, current.plan, weights, seen)
            nxt = await anext(batches, None)  # may wait for the next chunk's decoding
            if nxt is None:
                await self._push(current, grads, counts)
                break
            # This mini-batch's push and the next one's pull travel in one
            # request per shard; each shard applies the push before reading
            # the pull, so the next mini-batch is predicted by weights that
            # have learnt from this one, as before.
            following = planned(nxt)
            weights = await self._push_pull(current, grads, counts, following)
            current = following
            # In-process shards never suspend: give the fetcher its turn, so
            # the next window arrives while this one trains.
            await asyncio.sleep(0)

    async def _overlapped(
        self, batches: AsyncIterator[EventBatch], planned: Callable[[EventBatch], _Step], seen: _Progressive
    ) -> None:
        """`depth` mini-batches in flight: the first D pulled at once, then
        mini-batch k's push carries mini-batch k+D's pull, so the requests of
        D mini-batches travel while this one trains. The tasks are awaited in
        mini-batch order, so the first failure raised is the earliest
        mini-batch's (the rest are cancelled, as `fan_out` does); every push
        is acknowledged before this returns."""
        ahead: collections.deque[tuple[_Step, asyncio.Task[dict[str, F32]]]] = collections.deque()
        acks: list[asyncio.Task[None]] = []
        try:
            while len(ahead) < self.depth and (sub := await anext(batches, None)) is not None:
                step = planned(sub)
                ahead.append((step, asyncio.create_task(self._pull(step))))
            while ahead:
                step, pulling = ahead.popleft()
                weights = await pulling  # its pull, and the push D mini-batches back acknowledged
                grads, counts = self._learn(step.batch, step.plan, weights, seen)
                nxt = await anext(batches, None)
                if nxt is None:  # the window's last D mini-batches: pushes alone
                    acks.append(asyncio.create_task(self._push(step, grads, counts)))
                else:
                    following = planned(nxt)
                    ahead.append((following, asyncio.create_task(self._push_pull(step, grads, counts, following))))
            for ack in acks:
                await ack
        finally:
            # A failure or a cancellation part-way: nothing left running, and
            # every task's outcome retrieved (only the first failure is raised).
            tasks = [t for _, t in ahead] + acks
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(eq=False, kw_only=True)
class SyncTraining(Training):
    """Sync mode: each mini-batch a step of the workers inside a window."""

    control: ControlClient
    member: str
    deadline_s: float

    async def train(self, pieces: AsyncIterator[EventBatch], window: Window) -> Metrics:
        """Pull, predict, push the gradients (the shards hold them), arrive
        at the barrier; when the step closes every shard applies the sum of
        the step's gradients once, and the next step pulls.

        The worker is a member from its window's first step to its end, so a
        worker waiting for records holds nobody up."""
        names, model = self.model.table_names, self.model.name
        seen = _Progressive()
        await self.control.sync_join(self.member, model)
        try:
            async for sub in self._mini_batches(pieces):  # no ramp: a step is every member's
                plan = self.model.plan(sub)
                routed = self.client.route(plan.keys)
                weights = dict(zip(names, await per_table([self.client.pull(t, routed) for t in names])))
                grads, counts = self._learn(sub, plan, weights, seen)
                event_time = _event_time(sub, window)
                await per_table(
                    [self.client.push(t, routed, grads[t], counts=counts, event_time=event_time) for t in names]
                )
                step = await self.control.sync_arrive(self.member, self.deadline_s, model)
                await self.control.sync_apply(step, names)
                self.stats.sync_steps += 1
        finally:
            # Shielded: a cancelled window still leaves, or the others wait out the deadline.
            with contextlib.suppress(PSError, OSError):
                await asyncio.shield(self.control.sync_leave(self.member, model))
        self.stats.events_trained += seen.events
        return seen.metrics()


@dataclass(eq=False, kw_only=True)
class GeoTraining(Training):
    """Geo mode: a local copy trained, its differences pushed every
    `geo_steps` mini-batches and at the window's end."""

    geo_steps: int
    max_rows: InitVar[int]
    """Rows the local copy holds at most (`GeoCopy`)."""
    scale: Callable[[], float]
    """What the differences are scaled by, read at each window's start."""
    ramp: int = DEFAULT_RAMP
    """The local copy's mini-batches ramp as async's do (`MiniBatchRamp`; 0: none)."""
    copy: GeoCopy = field(init=False)
    feed: ChangeFeed = field(init=False)
    """What other workers changed since the last round (the shards' change logs)."""

    def __post_init__(self, max_rows: int) -> None:
        self.copy = GeoCopy(self.model.tables(), max_rows=max_rows)
        self.feed = ChangeFeed(self.client, self.model.table_names)

    def reset(self) -> None:
        self.copy.clear()
        self.feed.reset()

    async def train(self, pieces: AsyncIterator[EventBatch], window: Window) -> Metrics:
        """Mini-batches trained on the local copy; the window's commit covers
        every update it made, pushed before this returns.

        Progressive validation as in async: each event is predicted by the
        local copy before its mini-batch trains it."""
        geo, names = self.copy, self.model.table_names
        seen = _Progressive()
        scale = self.scale()
        steps = 0
        last_ts = -np.inf  # the round's latest event time
        async for sub in self._mini_batches(pieces, self.ramp):
            plan = self.model.plan(sub)
            rows, need = geo.locate(plan.keys)
            if need.any():
                routed = self.client.route(plan.keys[need])
                # Not pushed as such: the round pushes the rows it moved.
                pulled = await per_table([self.client.pull(t, routed, for_push=False) for t in names])
                rows = geo.take(plan.keys, rows, need, dict(zip(names, pulled)))
            weights = geo.weights(rows)
            grads, counts = self._learn(sub, plan, weights, seen)
            geo.train(rows, grads, counts)
            ts = sub.ts[np.isfinite(sub.ts)]
            last_ts = max(last_ts, float(ts.max())) if ts.size else last_ts
            steps += 1
            if steps % self.geo_steps == 0:
                await self._push(scale, last_ts if np.isfinite(last_ts) else _window_time(window))
                last_ts = -np.inf
            await asyncio.sleep(0)  # in-process shards never suspend: let the fetcher run
        if steps % self.geo_steps:
            await self._push(scale, last_ts if np.isfinite(last_ts) else _window_time(window))
        self.stats.events_trained += seen.events
        return seen.metrics()

    async def _push(self, scale: float, event_time: float) -> None:
        """Push the copy's differences since the last push and take the
        shards' merged weights back (one push-pull per table and shard),
        then ask which rows other workers changed meanwhile."""
        geo, names = self.copy, self.model.table_names
        d = geo.deltas(scale)
        if d.keys.size:
            routed = self.client.route(d.keys)
            ids = [self.client.new_request_id() for _ in names]
            got = await per_table(
                [
                    self.client.push_pull(
                        t, routed, d.values[t], pull_keys=routed, counts=d.counts, event_time=event_time, request_id=i
                    )
                    for t, i in zip(names, ids)
                ]
            )
            for t, i in zip(names, ids):
                self.feed.pushed(t, i)
            geo.merge(d.rows, {t: w for t, (_, w) in zip(names, got)})
        changed = await self.feed.read()
        geo.end_round(d.rows, changed)
        self.stats.geo_rounds += 1
        self.stats.geo_full_refreshes += changed is None
