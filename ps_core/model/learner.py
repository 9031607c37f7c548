"""Learning without Kafka or shards, for trying things out (`Learner`).

``Learner("lr").learn(events)`` trains a model in this process on a list of
events (the JSON objects a worker reads: ``features``, ``label``, optional
``keys`` and ``weight``), mini-batch by mini-batch exactly as a worker's
async training does, and returns the progressive metrics (each event
predicted before it is learnt from); ``predict(events)`` scores events with
the weights learnt so far. The tables are the model's own `SparseTable`s,
with the optimizers and defaults a cluster would use, so what is learnt
here is what a worker would learn from the same events in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidRequestError
from ..store.table import SparseTable
from .batch import EventBatch
from .events import EventError
from .metrics import Metrics, evaluate
from .models import make_model, sigmoid
from .ramp import DEFAULT_RAMP, MiniBatchRamp

__all__ = ["FEATURIZE_EVENTS", "Learner"]

FEATURIZE_EVENTS = 2048
"""Events a `Learner` validates and hashes at once, as a worker's decode job
does: a chunk's numpy temporaries (~75k feature values) stay in the CPU's
caches. On the quality stream, featurizing runs at ~200k events/s in chunks
of 1,024-4,096 events against ~150k in chunks of 8,192 and ~140k of 20,000."""


class Learner:
    """A model and its tables in this process: `learn`, then `predict`."""

    def __init__(
        self, kind: str = "lr", name: str = "ctr", *, mini_batch: int = 256, ramp: int = DEFAULT_RAMP, **model_args: Any
    ) -> None:
        """`kind` ``lr`` or ``fm`` (`model_args` as `make_model` takes them);
        `mini_batch` events per update and its `ramp` from the first events
        learnt, as ``ctrps worker --mini-batch --mini-batch-ramp`` (`MiniBatchRamp`)."""
        if mini_batch < 1:
            raise ValueError("mini_batch must be >= 1")
        self.sizes = MiniBatchRamp(mini_batch, ramp)
        self.model = make_model(kind, name, **model_args)
        self.tables = {t.name: SparseTable(t) for t in self.model.tables()}
        self.hasher = self.model.hasher()
        self.events_learnt = 0
        self.refused: dict[int, str] = {}
        """The last `learn` call's refused events: position → ``reason: detail``."""
        self.predicted: npt.NDArray[np.float64] = np.empty(0)
        """The last `learn` call's progressive predictions, one per event learnt."""

    def learn(self, events: Sequence[dict[str, Any]]) -> Metrics:
        """Train on `events` in order; their progressive metrics. Events that
        do not validate are skipped and listed in `refused`."""
        batch, errors = self._featurize(events)
        self.refused = {i: e.detail for i, e in errors.items()}
        predicted: list[npt.NDArray[np.float64]] = []
        start = 0
        while start < batch.size:  # per mini-batch, not per event
            stop = min(start + self.sizes.next_size(self.events_learnt + start), batch.size)
            predicted.append(self._step(batch.slice(start, stop)))
            start = stop
        self.events_learnt += batch.size
        self.predicted = np.concatenate(predicted) if predicted else np.empty(0)
        return evaluate(self.predicted, batch.labels)

    def predict(self, events: Sequence[dict[str, Any]]) -> npt.NDArray[np.float64]:
        """Click probabilities of `events` (labels not needed) from the
        weights learnt so far; `InvalidRequestError` naming the first event
        that does not validate."""
        batch, errors = self._featurize(events, require_label=False)
        if errors:
            i = min(errors)
            said = errors[i].detail  # some name their event already
            raise InvalidRequestError(said if f"event {i}:" in said else f"event {i}: {said}")
        plan = self.model.plan(batch)
        weights = {name: t.pull(plan.keys) for name, t in self.tables.items()}
        return sigmoid(self.model.logits(batch, plan, weights))

    def _featurize(
        self, events: Sequence[dict[str, Any]], require_label: bool = True
    ) -> tuple[EventBatch, dict[int, EventError]]:
        """`FeatureHasher.featurize` of `events`, `FEATURIZE_EVENTS` at a time
        (the same batch and errors as all at once)."""
        if len(events) <= FEATURIZE_EVENTS:
            return self.hasher.featurize(events, require_label=require_label)
        starts = range(0, len(events), FEATURIZE_EVENTS)
        pieces: list[EventBatch] = []
        errors: dict[int, EventError] = {}
        for start in starts:
            piece, errs = self.hasher.featurize(events[start : start + FEATURIZE_EVENTS], require_label=require_label)
            pieces.append(piece)
            # Keyed and named by the event's place in `events`, not in its piece.
            errors.update({start + i: _placed(e, i, start + i) for i, e in errs.items()})
        return EventBatch.concat(pieces, list(starts)), errors

    def _step(self, sub: EventBatch) -> npt.NDArray[np.float64]:
        """Predict a mini-batch, then learn from it (a worker's async step)."""
        plan = self.model.plan(sub)
        weights = {name: t.pull(plan.keys) for name, t in self.tables.items()}
        p = sigmoid(self.model.logits(sub, plan, weights))
        grads = self.model.gradients(sub, plan, weights, (p - sub.labels) * sub.weights)
        counts = plan.counts(sub.labels)
        for name, g in grads.items():
            self.tables[name].push(plan.keys, g, counts=counts)
        return p


def _placed(error: EventError, local: int, place: int) -> EventError:
    """`error`, found at `local` in a piece of the events, naming the event
    by its `place` among them all."""
    if local == place:
        return error
    said = error.detail.removeprefix(f"{error.reason}: ")
    return EventError(error.reason, said.replace(f"event {local}", f"event {place}", 1))
