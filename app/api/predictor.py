"""Serving: predictions and weight look-ups from the shards' current weights.

The same code as training: events are validated and hashed by
`ps_core.model.featurizer.FeatureHasher` (namespaced by the model's name), and scored
by `Model.plan` / `Model.logits` and a sigmoid, with one pull per table of the
batch's distinct feature ids.

Concurrent requests are scored together (dynamic batching): a request joins a
queue, and one background task takes everything queued, featurizes it in one
call, pulls once per table and hands each request its slice. Nothing waits
for a batch to fill: a lone request is scored at once, and under load the
requests that arrive while a batch is scored form the next one. The fixed
cost of featurizing and pulling (~100 µs) is paid per batch, not per request.
An event that fails validation fails only its own request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ps_core.errors import UnknownTableError
from ps_core.model.batch import EventBatch
from ps_core.model.events import EventError
from ps_core.model.models import Model, sigmoid
from ps_core.net.client import PSReader
from ps_core.net.transports import Pulled
from ps_core.parsing import exact_ints
from ps_core.waits import cancelled

from .errors import InvalidEventError, UnknownModelError

__all__ = ["Predictor", "Prediction", "WeightsLookup", "BIAS_NAME", "MAX_BATCH_EVENTS"]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]

BIAS_NAME = "(bias)"
"""How `Predictor.weights` names the bias feature every event has."""
MAX_BATCH_EVENTS = 4096
"""Requests are added to a batch while it holds fewer events than this."""


@dataclass(frozen=True)
class Prediction:
    """Click probabilities of one request's events."""

    probabilities: list[float]
    """In the order of the request's events."""
    version: int
    """The open export version of the weights read (smallest over tables and shards)."""


@dataclass(frozen=True)
class WeightsLookup:
    """The current weights of the features of one lookup, bias first."""

    names: list[str | None]
    """``field=value`` (categorical), ``field`` (numeric), `BIAS_NAME`, or
    None for a pre-hashed key."""
    keys: U64
    """Feature ids."""
    values: F32
    """The value each feature takes in the event (1 for categorical)."""
    weights: dict[str, F32]
    """Per table, (n, dim) weights."""
    present: npt.NDArray[np.bool_]
    """Whether each feature has a row in every table; absent ones read their initial value."""
    version: int
    """The open export version of the weights read."""


@dataclass
class _Pending:
    events: list[dict[str, Any]]
    future: asyncio.Future[Prediction]


class Predictor:
    """Scores events with `model` from the weights on the shards of `client`.

    ``await start()`` before use (it starts the batching task) and
    ``await stop()`` after (idempotent); or ``async with``.
    """

    def __init__(
        self,
        client: PSReader[Any],
        model: Model,
        *,
        max_batch_events: int = MAX_BATCH_EVENTS,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_batch(requests, events)` is called for each batch scored (metrics)."""
        self.client = client
        self.model = model
        self.hasher = model.hasher()
        self.max_batch_events = max_batch_events
        self._on_batch = on_batch
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the batching task."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ctrps-predictor")

    async def stop(self) -> None:
        """Stop the batching task; queued requests are cancelled."""
        task, self._task = self._task, None
        if task is not None:
            await cancelled(task)
        while self._queue:
            self._queue.popleft().future.cancel()

    async def __aenter__(self) -> Predictor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- predictions -----------------------------------------------------------
    async def predict(self, events: list[dict[str, Any]]) -> Prediction:
        """Click probabilities of `events` (each with ``features`` and/or ``keys``).

        Raises `InvalidEventError` naming the first bad event,
        `UnknownModelError` when the model's tables are not on the shards, and
        `ps_core` errors (`ShardUnavailableError`) from the pulls."""
        task = self._task
        if task is None:
            raise RuntimeError("Predictor.start() was not awaited")
        if task.done():
            # The batching task never ends by itself: surface why it did.
            task.result()
            raise RuntimeError("the predictor's batching task has stopped")
        future: asyncio.Future[Prediction] = task.get_loop().create_future()
        self._queue.append(_Pending(events, future))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            # One turn of the loop for the handlers of requests already read
            # to join: a batch's fixed cost is most of a small one's.
            await asyncio.sleep(0)
            batch = [self._queue.popleft()]
            n = len(batch[0].events)
            while self._queue and n < self.max_batch_events:
                batch.append(self._queue.popleft())
                n += len(batch[-1].events)
            try:
                outcomes = await self._score_requests([p.events for p in batch])
            except asyncio.CancelledError:
                for p in batch:
                    p.future.cancel()
                raise
            except Exception as exc:  # a shard error fails every request of the batch
                outcomes = [exc] * len(batch)
            for p, outcome in zip(batch, outcomes):
                if p.future.done():  # the request was cancelled meanwhile
                    continue
                if isinstance(outcome, Exception):
                    p.future.set_exception(outcome)
                else:
                    p.future.set_result(outcome)
            if self._on_batch is not None:
                self._on_batch(len(batch), n)
            # Let the handlers answer before the next batch is scored: with
            # in-process shards scoring never suspends, and the answers would
            # otherwise wait for every queued batch.
            await asyncio.sleep(0)

    async def _score_requests(self, requests: list[list[dict[str, Any]]]) -> list[Prediction | Exception]:
        """Score several requests' events as one batch; each request gets its
        predictions or the error of its first bad event."""
        sizes = [len(r) for r in requests]
        events = requests[0] if len(requests) == 1 else list(itertools.chain.from_iterable(requests))
        # A request is a group: one bad event fails its request, not the batch.
        groups = [0] * len(events) if len(requests) == 1 else np.repeat(np.arange(len(requests)), sizes).tolist()
        batch, errors = self.hasher.featurize(events, require_label=False, groups=groups)
        probabilities: F64 = np.zeros(0)
        version = 0
        if batch.size:
            probabilities, version = await self._score(batch)
        # Failed requests are left out whole, so each good request's events
        # are a contiguous run of the batch, starting where its first event went.
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        firsts = np.searchsorted(batch.index, starts).tolist()
        # Slices of a list, not of the array: a numpy slice per request cost
        # more than the list, and orjson writes floats of a list directly.
        listed = probabilities.tolist()
        out: list[Prediction | Exception] = []
        for g, request in enumerate(requests):  # per request, not per event
            if g in errors:
                out.append(self._event_error(request))
            else:
                out.append(Prediction(listed[firsts[g] : firsts[g] + sizes[g]], version))
        return out

    async def _score(self, batch: EventBatch) -> tuple[F64, int]:
        plan = self.model.plan(batch)
        pulled = await self._pull(plan.keys, presence=False)
        weights = {t: p.weights for t, p in pulled.items()}
        p = sigmoid(self.model.logits(batch, plan, weights))
        return p, min(x.version for x in pulled.values())

    async def _pull(self, keys: U64, *, presence: bool) -> dict[str, Pulled]:
        """One pull per table of `keys` (routed once for all tables)."""
        names = self.model.table_names
        routed = self.client.route(keys)
        try:
            if len(names) == 1:
                got = [await self.client.pull_versioned(names[0], routed, presence=presence)]
            else:
                got = await asyncio.gather(*(self.client.pull_versioned(t, routed, presence=presence) for t in names))
        except UnknownTableError as exc:
            raise UnknownModelError(
                f"model {self.model.name!r} is not on the shards yet (its tables are "
                f"declared by the first worker that trains it): {exc.detail}"
            ) from None
        return dict(zip(names, got))

    def _event_error(self, events: list[dict[str, Any]]) -> InvalidEventError:
        """The first bad event of a failed request, by its position in the
        request (featurized again on its own: the error path only)."""
        _, errors = self.hasher.featurize(events, require_label=False)
        i = min(errors)
        err = errors[i]
        return _invalid_event(err, i)

    # -- weights ---------------------------------------------------------------
    async def weights(self, features: dict[str, Any] | None, keys: list[Any] | None) -> WeightsLookup:
        """The current weights of an event's features (`features` and/or
        pre-hashed `keys`), bias first, each named, with its presence."""
        event: dict[str, Any] = {}
        if features is not None:
            event["features"] = features
        if keys is not None:
            keys = event["keys"] = exact_ints(keys)
        # The training path's validation, so a lookup accepts exactly what an event may hold.
        _, errors = self.hasher.featurize([event], require_label=False)
        if errors:
            raise _invalid_event(errors[0], 0)
        names, ids, values = self._named_features(features or {}, keys or [])
        pulled = await self._pull(ids, presence=True)
        present = np.ones(ids.size, dtype=bool)
        for p in pulled.values():
            assert p.present is not None
            present &= p.present
        return WeightsLookup(
            names=names,
            keys=ids,
            values=values,
            weights={t: p.weights for t, p in pulled.items()},
            present=present,
            version=min(p.version for p in pulled.values()),
        )

    def _named_features(self, features: dict[str, Any], keys: list[int]) -> tuple[list[str | None], U64, F32]:
        """Names, ids and values (as the model is fed them) of validated
        features, in request order."""
        fields: list[str] = []
        cats: list[str | None] = []
        values: list[float] = [1.0]
        names: list[str | None] = [BIAS_NAME]
        # One lookup's features (at most the hasher's limit): naming each is this route's job.
        for field, v in features.items():
            if v is None:
                continue
            if isinstance(v, bool):
                v = "true" if v else "false"
            items = [v] if isinstance(v, str) else v if isinstance(v, list) else None
            if items is None:  # a number, fed as the model feeds it
                fields.append(field)
                cats.append(None)
                values.append(float(self.hasher.fed_values(float(v))))
                names.append(field)
                continue
            fields.extend([field] * len(items))
            cats.extend(items)
            values.extend([1.0] * len(items))
            names.extend(f"{field}={s}" for s in items)
        ids = np.concatenate(
            [
                np.array([self.hasher.bias_key], dtype=np.uint64),
                self.hasher.feature_ids(fields, cats),
                np.array(keys, dtype=np.uint64),
            ]
        )
        names.extend([None] * len(keys))
        values.extend([1.0] * len(keys))
        return names, ids, np.array(values, dtype=np.float32)


def _invalid_event(err: EventError, event: int) -> InvalidEventError:
    # The hasher's detail repeats the reason and sometimes the event: keep the rest.
    detail = err.detail.removeprefix(f"{err.reason}: ").removeprefix(f"event {event}: ")
    return InvalidEventError(err.reason, event, detail)
