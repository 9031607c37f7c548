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
from .metrics import Metrics, evaluate
from .models import make_model, sigmoid

__all__ = ["Learner"]


class Learner:
    """A model and its tables in this process: `learn`, then `predict`."""

    def __init__(self, kind: str = "lr", name: str = "ctr", *, mini_batch: int = 256, **model_args: Any) -> None:
        """`kind` ``lr`` or ``fm`` (`model_args` as `make_model` takes them);
        `mini_batch` events per update, as ``ctrps worker --mini-batch``."""
        if mini_batch < 1:
            raise ValueError("mini_batch must be >= 1")
        self.model = make_model(kind, name, **model_args)
        self.tables = {t.name: SparseTable(t) for t in self.model.tables()}
        self.hasher = self.model.hasher()
        self.mini_batch = mini_batch
        self.events_learnt = 0
        self.refused: dict[int, str] = {}
        """The last `learn` call's refused events: position → ``reason: detail``."""
        self.predicted: npt.NDArray[np.float64] = np.empty(0)
        """The last `learn` call's progressive predictions, one per event learnt."""

    def learn(self, events: Sequence[dict[str, Any]]) -> Metrics:
        """Train on `events` in order; their progressive metrics. Events that
        do not validate are skipped and listed in `refused`."""
        batch, errors = self.hasher.featurize(events)
        self.refused = {i: e.detail for i, e in errors.items()}
        predicted: list[npt.NDArray[np.float64]] = []
        for start in range(0, batch.size, self.mini_batch):  # per mini-batch, not per event
            sub = batch.slice(start, min(start + self.mini_batch, batch.size))
            p = self._step(sub)
            predicted.append(p)
        self.events_learnt += batch.size
        self.predicted = np.concatenate(predicted) if predicted else np.empty(0)
        return evaluate(self.predicted, batch.labels)

    def predict(self, events: Sequence[dict[str, Any]]) -> npt.NDArray[np.float64]:
        """Click probabilities of `events` (labels not needed) from the
        weights learnt so far; `InvalidRequestError` naming the first event
        that does not validate."""
        batch, errors = self.hasher.featurize(events, require_label=False)
        if errors:
            i = min(errors)
            raise InvalidRequestError(f"event {i}: {errors[i].detail}")
        plan = self.model.plan(batch)
        weights = {name: t.pull(plan.keys) for name, t in self.tables.items()}
        return sigmoid(self.model.logits(batch, plan, weights))

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
