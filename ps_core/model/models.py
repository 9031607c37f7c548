"""CTR models: logits and gradients for a batch, shared by training and serving.

A model knows its tables and, for an `EventBatch` and the weights pulled for
its distinct feature ids, computes logits and the gradient of the log loss per
distinct id. Training and serving call the same code::

    plan = model.plan(batch)                      # distinct ids, once per batch
    weights = {t: await client.pull(t, plan.keys) for t in model.table_names}
    logits = model.logits(batch, plan, weights)
    grads = model.gradients(batch, plan, weights, dlogit)   # dlogit = (p - y) * weight

Gradients are sums over the batch (not means): FTRL and AdaGrad scale each
coordinate by its own accumulated squares, so a feature seen 50 times in a
batch moves as 50 online steps would, approximately.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import TableConfigError
from ..hashing import U64, distinct
from ..store.optim import FTRLMixture, make_optimizer
from ..store.table_config import TableConfig
from .batch import EventBatch
from .featurizer import DEFAULT_NUMERIC, FeatureHasher, numeric_feed
from .mixture import bias_rows, learner_gradients, mixed_logits

__all__ = [
    "Model",
    "LogisticRegression",
    "FactorizationMachine",
    "BatchPlan",
    "sigmoid",
    "make_model",
    "model_of_tables",
    "DEFAULT_LINEAR_OPTIMIZER",
    "DEFAULT_EMBEDDING_OPTIMIZER",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


DEFAULT_LINEAR_OPTIMIZER: dict[str, Any] = {"name": "ftrl", "alpha": 0.2, "beta": 0.1, "l1": 0.5, "l2": 1.0}
"""FTRL settings of the linear part, chosen by `bench/studies/linear_defaults.py`
on half of the synthetic profiles and seeds (the smallest largest regret of
progressive log loss over them, at the numeric feed
`ps_core.model.featurizer.DEFAULT_NUMERIC` and the mini-batch ramp) and reported
on the other half (docs/defaults.md)."""
DEFAULT_EMBEDDING_OPTIMIZER: dict[str, Any] = {"name": "adagrad", "lr": 0.003}
"""AdaGrad of FM's embeddings. `bench/studies/fm_rate.py` chose the rate: the largest
at which FM's log loss is at most LR's on every stream it runs at the default
numeric feed (0.003 of 0.001-0.05; on streams whose interactions matter more, a
larger rate learns them faster)."""


def sigmoid(z: F64) -> F64:
    """Numerically safe logistic function."""
    out: F64 = 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))
    return out


@dataclass(frozen=True)
class BatchPlan:
    """The distinct feature ids of a batch and where each occurrence points."""

    keys: U64
    """Distinct feature ids (what to pull and push)."""
    inverse: I64
    """(nnz,) index into `keys` of each feature occurrence."""
    event_of: I64
    """(nnz,) the event of each feature occurrence."""

    def sum_to_keys(self, per_occurrence: F64 | F32) -> F32:
        """Sum per-occurrence values (nnz,) or (nnz, d) onto the distinct ids."""
        u = self.keys.size
        if per_occurrence.ndim == 1:
            return np.bincount(self.inverse, per_occurrence, u).astype(np.float32)[:, None]
        out = np.empty((u, per_occurrence.shape[1]), dtype=np.float32)
        for j in range(per_occurrence.shape[1]):  # per embedding column, not per key
            out[:, j] = np.bincount(self.inverse, per_occurrence[:, j], u)
        return out

    def counts(self, labels: F32, events: npt.NDArray[np.bool_] | None = None) -> F32:
        """(u, 2) shows and clicks of each distinct id in the batch (of the
        `events` marked only, if given)."""
        u = self.keys.size
        out = np.empty((u, 2), dtype=np.float32)
        if events is None:
            out[:, 0] = np.bincount(self.inverse, minlength=u)
            out[:, 1] = np.bincount(self.inverse, labels[self.event_of].astype(np.float64), u)
        else:
            kept = events[self.event_of].astype(np.float64)
            out[:, 0] = np.bincount(self.inverse, kept, u)
            out[:, 1] = np.bincount(self.inverse, np.where(kept > 0, labels[self.event_of], 0.0), u)
        return out


def _segment_sum(values: F64, offsets: I64) -> F64:
    """Per-event sums of per-occurrence values; every event has >= 1 occurrence (its bias)."""
    out: F64 = np.add.reduceat(values, offsets[:-1], axis=0)
    return out


class Model(ABC):
    """A CTR model over named tables."""

    name: str
    numeric: str = DEFAULT_NUMERIC
    """How its numeric features are fed (`ps_core.model.featurizer.NUMERIC`): its
    events are hashed so in training and in serving."""
    kind: ClassVar[str]
    """``lr`` or ``fm``: what `make_model` and ``ctrps model create --type`` call it."""

    @abstractmethod
    def tables(self) -> tuple[TableConfig, ...]:
        """The tables this model reads and trains."""

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables())

    @property
    def mode(self) -> str:
        """How workers update the model (its tables' `TableConfig.mode`)."""
        return self.tables()[0].mode

    def plan(self, batch: EventBatch) -> BatchPlan:
        """Distinct ids of `batch` and the occurrence → id map."""
        keys, inverse = distinct(batch.keys)
        return BatchPlan(keys, inverse, batch.event_of_feature())

    @abstractmethod
    def logits(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> F64:
        """(n,) logits of the batch's events."""

    @abstractmethod
    def gradients(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32], dlogit: F64) -> dict[str, F32]:
        """Per table, (u, dim) gradients for `plan.keys`, given dLoss/dlogit per event."""

    def config(self) -> dict[str, Any]:
        """A JSON-ready description (model info, export manifests)."""
        return {
            "kind": type(self).__name__,
            "name": self.name,
            "numeric": self.numeric,
            "tables": [t.to_dict() for t in self.tables()],
        }

    def hasher(self) -> FeatureHasher:
        """A hasher of this model's events: its namespace, its numeric handling."""
        return FeatureHasher(self.name, numeric=self.numeric)

    def _linear(
        self, name: str, optimizer: dict[str, Any] | None, mode: str, max_staleness: int | None, numeric: str
    ) -> TableConfig:
        """Set `name` and `numeric` (checked); the linear table ``<name>_w``
        (bias included) that every model has: dim 1, or 2K for a mixture of
        K learners (`ps_core.model.mixture`)."""
        self.name = name
        self.numeric = _numeric(numeric)
        spec = dict(optimizer or DEFAULT_LINEAR_OPTIMIZER)
        rule = make_optimizer(spec)
        self.mixture = rule if isinstance(rule, FTRLMixture) else None
        """The linear part's mixture of learners, if its optimizer is one."""
        dim = 1 if self.mixture is None else 2 * self.mixture.learners
        return TableConfig(f"{name}_w", dim, spec, mode=mode, max_staleness=max_staleness)

    def _linear_logits(self, table: str, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> F64:
        """(n,) the linear part's logits; (n, K), the learners', for a mixture."""
        w = weights[table].astype(np.float64)
        if self.mixture is None:
            return _segment_sum(w[:, 0][plan.inverse] * batch.values, batch.offsets)
        k = self.mixture.learners
        return _segment_sum(w[:, :k].take(plan.inverse, axis=0) * batch.values[:, None], batch.offsets)

    def _mixed(self, table: str, z: F64, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> F64:
        """(n,) logits from the linear part's `z`: mixed for a mixture."""
        if self.mixture is None:
            return z
        k = self.mixture.learners
        m = weights[table][:, k:].astype(np.float64).take(bias_rows(batch, plan.inverse), axis=0)
        return mixed_logits(z, m, self.mixture.cap)

    @staticmethod
    def _learner_gradients(mixture: FTRLMixture, z: F64, batch: EventBatch, plan: BatchPlan) -> F32:
        """A mixture's push of its linear table from its learners' logits `z`
        (n, K): each learner's own gradient and loss (`learner_gradients`)."""
        return learner_gradients(batch, z, plan.inverse, plan.event_of, plan.keys.size, mixture.cap)


class LogisticRegression(Model):
    """``logit = sum_i w_i x_i`` over an event's features (bias included).

    One table, ``<name>_w``, dim 1."""

    kind = "lr"

    def __init__(
        self,
        name: str = "ctr",
        optimizer: dict[str, Any] | None = None,
        *,
        mode: str = "async",
        max_staleness: int | None = None,
        numeric: str = DEFAULT_NUMERIC,
    ) -> None:
        """`optimizer`: its table's (default `DEFAULT_LINEAR_OPTIMIZER`);
        `mode` and `max_staleness`: how workers update it (`TableConfig`);
        `numeric`: how its numeric features are fed."""
        self._table = self._linear(name, optimizer, mode, max_staleness, numeric)

    def tables(self) -> tuple[TableConfig, ...]:
        return (self._table,)

    def logits(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> F64:
        name = self._table.name
        return self._mixed(name, self._linear_logits(name, batch, plan, weights), batch, plan, weights)

    def gradients(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32], dlogit: F64) -> dict[str, F32]:
        name, mixture = self._table.name, self.mixture
        if mixture is None:
            return {name: plan.sum_to_keys(dlogit[plan.event_of] * batch.values)}
        return {name: self._learner_gradients(mixture, self._linear_logits(name, batch, plan, weights), batch, plan)}


class FactorizationMachine(Model):
    """Rendle's FM: ``logit = sum_i w_i x_i + sum_{i<j} <v_i, v_j> x_i x_j``.

    Tables ``<name>_w`` (dim 1, bias included) and ``<name>_v`` (dim k,
    embeddings starting at uniform(+-init_scale) from the key). The bias takes
    no part in the interactions. Pairwise term computed as
    ``0.5 * sum_f [(sum_i v_if x_i)^2 - sum_i v_if^2 x_i^2]``."""

    kind = "fm"

    def __init__(
        self,
        name: str = "ctr",
        k: int = 8,
        optimizer: dict[str, Any] | None = None,
        embedding_optimizer: dict[str, Any] | None = None,
        init_scale: float = 0.01,
        seed: int = 0,
        *,
        mode: str = "async",
        max_staleness: int | None = None,
        numeric: str = DEFAULT_NUMERIC,
    ) -> None:
        """`k`: the embeddings' dim; `optimizer` and `embedding_optimizer`:
        the linear and the embedding table's; `init_scale` and `seed`: the
        embeddings' start. `mode`, `max_staleness` and `numeric` as for
        `LogisticRegression`."""
        self._w = self._linear(name, optimizer, mode, max_staleness, numeric)
        self.k = k
        spec = dict(embedding_optimizer or DEFAULT_EMBEDDING_OPTIMIZER)
        if spec.get("name") == FTRLMixture.name:
            # Its last K columns would be log-weights, shifted and clipped at
            # every push, not embeddings (a table of k = 2K passes its dim check).
            raise TableConfigError(
                f"table {name}_v: ftrl_mix mixes the linear table's learners; "
                "the embeddings take sgd, adagrad, ftrl or coin"
            )
        self._v = TableConfig(
            f"{name}_v",
            k,
            spec,
            init_scale=init_scale,
            seed=seed,
            mode=mode,
            max_staleness=max_staleness,
        )

    def tables(self) -> tuple[TableConfig, ...]:
        return (self._w, self._v)

    def _interaction_inputs(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> tuple[F64, F64, F64]:
        x = batch.values.astype(np.float64)
        x[batch.offsets[:-1]] = 0.0  # the bias position of each event
        v = weights[self._v.name].astype(np.float64).take(plan.inverse, axis=0)  # (nnz, k); `ps_core.rows`
        vx = v * x[:, None]
        s = _segment_sum(vx, batch.offsets)  # (n, k)
        return x, v, s

    def _z(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> tuple[F64, tuple[F64, F64, F64]]:
        """The linear part's logits plus the pairs' (n,), or (n, K) for a
        mixture's learners, which share the pairs; and the pairs' inputs."""
        linear = self._linear_logits(self._w.name, batch, plan, weights)
        x, v, s = inputs = self._interaction_inputs(batch, plan, weights)
        sq = _segment_sum((v * v) * (x * x)[:, None], batch.offsets)
        pairs = 0.5 * (s * s - sq).sum(axis=1)
        z: F64 = linear + (pairs if linear.ndim == 1 else pairs[:, None])
        return z, inputs

    def logits(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32]) -> F64:
        return self._mixed(self._w.name, self._z(batch, plan, weights)[0], batch, plan, weights)

    def gradients(self, batch: EventBatch, plan: BatchPlan, weights: dict[str, F32], dlogit: F64) -> dict[str, F32]:
        g_occ, mixture = dlogit[plan.event_of], self.mixture
        if mixture is None:
            x, v, s = self._interaction_inputs(batch, plan, weights)
            linear = plan.sum_to_keys(g_occ * batch.values)
        else:
            z, (x, v, s) = self._z(batch, plan, weights)
            linear = self._learner_gradients(mixture, z, batch, plan)
        # d logit / d v_if = x_i * s_f - v_if * x_i^2; the embeddings follow
        # the mixed logit's dlogit (a mixture's learners share them).
        gv = g_occ[:, None] * (x[:, None] * s.take(plan.event_of, axis=0) - v * (x * x)[:, None])
        return {self._w.name: linear, self._v.name: plan.sum_to_keys(gv)}


def _numeric(numeric: str) -> str:
    numeric_feed(numeric)  # raises ValueError naming the forms
    return numeric


def model_of_tables(kind: str, name: str, tables: Sequence[TableConfig], numeric: str = "raw") -> Model:
    """The `kind` model `name` whose tables are `tables` (as a model's
    `tables()` declared them): a model rebuilt from its stored declaration
    (`ps_core.checkpoint.registry`). `ValueError` when they are not that
    model's tables."""
    by_name = {t.name: t for t in tables}
    w = by_name.get(f"{name}_w")
    if w is None:
        raise ValueError(f"model {name!r} has no table {name}_w")
    common: dict[str, Any] = {"mode": w.mode, "max_staleness": w.max_staleness, "numeric": numeric}
    if kind == "lr":
        model: Model = LogisticRegression(name, dict(w.optimizer), **common)
    elif kind == "fm":
        v = by_name.get(f"{name}_v")
        if v is None:
            raise ValueError(f"model {name!r} of type fm has no table {name}_v")
        model = FactorizationMachine(name, v.dim, dict(w.optimizer), dict(v.optimizer), v.init_scale, v.seed, **common)
    else:
        raise ValueError(f"unknown model type {kind!r}; expected lr or fm")
    if sorted(by_name) != sorted(model.table_names):
        raise ValueError(f"model {name!r} of type {kind} has tables {sorted(model.table_names)}, not {sorted(by_name)}")
    mine = {t.name: t for t in model.tables()}
    for t in tables:
        if not mine[t.name].accepts(replace(t, lifecycle=None)):
            raise ValueError(f"table {t.name} is not one model {name!r} of type {kind} declares: {t.to_dict()}")
    return model


def make_model(kind: str, name: str = "ctr", **kwargs: Any) -> Model:
    """``lr`` or ``fm`` by name."""
    if kind == "lr":
        return LogisticRegression(name, **kwargs)
    if kind == "fm":
        return FactorizationMachine(name, **kwargs)
    raise ValueError(f"unknown model {kind!r}; expected lr or fm")
