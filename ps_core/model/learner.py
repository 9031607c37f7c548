"""Learning without Kafka or shards, for trying things out (`Learner`).

``Learner("lr").learn(events)`` trains a model in this process on a list of
events (the JSON objects a worker reads: ``features``, ``label``, optional
``keys`` and ``weight``), mini-batch by mini-batch exactly as a worker's
async training does, and returns the progressive metrics (each event
predicted before it is learnt from); ``predict(events)`` scores events with
the weights learnt so far; ``save(dir)`` writes it as an export version that
``ctrps serve --follow`` serves, ``Learner.load(dir)`` reads one back. The tables are the model's own `SparseTable`s,
with the optimizers and defaults a cluster would use, so what is learnt
here is what a worker would learn from the same events in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
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

    def save(self, root: str | os.PathLike[str], *, take_over: bool = False) -> Path:
        """Write the model as a base export version ``<root>/<name>/<version>``
        (docs/export-format.md), as a shard 0 of a one-shard cluster writes
        it: what ``ctrps serve --follow <root>`` serves (``--follow
        <root>/<name>`` for a model not named ``ctr``) and `load` reads back.

        The version follows the newest one there, so a replica following the
        directory serves each save in turn. The root is claimed as a
        Learner's (``owner.json``, `ps_core.checkpoint.owner`): one a cluster
        owns raises `ExportsOwnedError` unless `take_over`. Returns the
        version's directory."""
        from ..checkpoint.export_files import version_dirs, write_version
        from ..checkpoint.owner import LEARNER, claim_exports

        claim_exports(Path(root), LEARNER, "ps_core.Learner", take_over=take_over)
        model_dir = Path(root) / self.model.name
        version = max([max(version_dirs(model_dir), default=0) + 1, *(t.version for t in self.tables.values())])
        snapshots = []
        for table in self.tables.values():
            if table.version < version:
                table.mark_exported(version - 1)  # the cut is a base: no delta tracking is lost
            snapshots.append(table.snapshot())
        config = {
            **self.model.config(),
            # What `load` needs to continue as this Learner would: the same mini-batches.
            "learner": {"events_learnt": self.events_learnt, "mini_batch": self.sizes.size, "ramp": self.sizes.ratio},
        }
        return write_version(Path(root), self.model.name, version, None, {0: snapshots}, {}, config, 1)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], name: str = "ctr", *, mini_batch: int | None = None, ramp: int | None = None
    ) -> Learner:
        """A Learner holding the newest complete chain in `path`: a model
        directory, or an exports root holding `name` (as `save` writes it, or
        a cluster's exports). Every file is checked against the manifest's
        SHA-256; the model is the one the manifest describes. Learning goes on
        where a saved Learner stopped (its mini-batch ramp included) unless
        `mini_batch` or `ramp` say otherwise. `ExportNotFoundError` when there
        is no version, `ExportCorruptError` naming a damaged file, `ValueError`
        when the tables are not a model's."""
        from ..checkpoint.export_files import latest_chain, version_dirs
        from ..checkpoint.manifest_model import model_from_manifest
        from ..checkpoint.restore import restore_shards

        model_dir = Path(path)
        if not version_dirs(model_dir):
            model_dir = model_dir / name
        chain = latest_chain(model_dir, verify=True)
        model = model_from_manifest(chain[-1].manifest)
        saved = chain[-1].manifest.model_config.get("learner")
        saved = saved if isinstance(saved, dict) else {}
        learner = cls(
            model.kind,
            model.name,
            mini_batch=int(saved.get("mini_batch", 256)) if mini_batch is None else mini_batch,
            ramp=int(saved.get("ramp", DEFAULT_RAMP)) if ramp is None else ramp,
        )
        (shard,) = restore_shards(chain, 1).shards
        learner.model, learner.hasher = model, model.hasher()
        learner.tables = {n: shard.tables[n] for n in model.table_names}
        learner.events_learnt = int(saved.get("events_learnt", 0))
        return learner

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
