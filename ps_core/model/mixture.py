"""A mixture of K linear learners in one table (`ps_core.store.optim.FTRLMixture`).

The linear table of a mixture model holds, per feature, the K learners'
weights and then K columns ``m`` that only the model's bias row fills: each
learner's progressive log loss, in units of `cap` nats. An event's
probability is the Bayesian mixture of the learners' ::

    p = sum_k pi_k sigmoid(z_k),   pi_k ∝ exp(-cap m_k)

whose log loss over a stream is at most ``log K`` above the best learner's.
Each learner trains on its own gradient ``(sigmoid(z_k) - y) x``; the
losses it suffered (on the weights it predicted with) go to the bias row's
``m``, where the shards add them. Everything stays one table, pulled and
pushed with the batch's own keys, so every update mode, export and replica
carries the mixture as it carries any other rows.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .batch import EventBatch

__all__ = ["mixed_logits", "learner_gradients", "bias_rows", "pairs_scale"]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def _log_sigmoid(z: F64) -> F64:
    out: F64 = -np.logaddexp(0.0, -z)
    return out


def _log_prior(m: F64, cap: float) -> F64:
    """(n, K) log pi of each event's learners, from its bias row's `m`."""
    a = -cap * m
    out: F64 = a - np.logaddexp.reduce(a, axis=1, keepdims=True)
    return out


def mixed_logits(z: F64, m: F64, cap: float) -> F64:
    """(n,) logits of the mixed probabilities of the learners' logits `z`
    (n, K), each event mixed by `m` (n, K), its bias row's log-weights."""
    log_pi = _log_prior(m, cap)
    log_p = np.logaddexp.reduce(log_pi + _log_sigmoid(z), axis=1)
    log_q = np.logaddexp.reduce(log_pi + _log_sigmoid(-z), axis=1)
    out: F64 = log_p - log_q
    return out


def pairs_scale(z: F64, m: F64, cap: float) -> F64:
    """(n,) how the mixture's log loss moves with a term every learner's
    logit shares (an FM's pairs), over its dlogit ``p - y``: ``sum_k pi_k
    s_k (1 - s_k) / (p (1 - p))`` with ``s_k = sigmoid(z_k)``. It is in
    [0, 1], and 1 where the learners agree."""
    log_pi = _log_prior(m, cap)
    up, down = _log_sigmoid(z), _log_sigmoid(-z)
    both = np.logaddexp.reduce(log_pi + up + down, axis=1)
    log_p = np.logaddexp.reduce(log_pi + up, axis=1)
    log_q = np.logaddexp.reduce(log_pi + down, axis=1)
    out: F64 = np.exp(np.minimum(both - log_p - log_q, 0.0))
    return out


def bias_rows(batch: EventBatch, inverse: I64) -> I64:
    """(n,) the distinct id of each event's bias (its first feature)."""
    out: I64 = inverse[batch.offsets[:-1]]
    return out


def learner_gradients(batch: EventBatch, z: F64, inverse: I64, event_of: I64, keys: int, cap: float) -> F32:
    """(keys, 2K) a push of the linear table: each learner's log-loss
    gradient per distinct id, then each learner's loss on the batch (over
    `cap`) on the rows of the events' bias. An event of weight 0 takes no
    part (a masked event: `consumers.training`)."""
    k = z.shape[1]
    y = batch.labels.astype(np.float64)[:, None]
    wt = batch.weights.astype(np.float64)
    live = wt != 0
    # (p_k - y) w per event and learner; 0 for an event of weight 0, even
    # where its logits are not finite.
    d = np.where(live[:, None], (0.5 * (1.0 + np.tanh(0.5 * z)) - y) * wt[:, None], 0.0)
    loss = np.where(live[:, None], -(y * _log_sigmoid(z) + (1.0 - y) * _log_sigmoid(-z)) * wt[:, None], 0.0)
    per_occurrence = d.take(event_of, axis=0) * batch.values.astype(np.float64)[:, None]
    bias = bias_rows(batch, inverse)
    out = np.zeros((keys, 2 * k), dtype=np.float32)
    # A sum past float32's range becomes infinite, and the caller finds the
    # events behind it (`consumers.training`): no warning for it here.
    with np.errstate(over="ignore"):
        for j in range(k):  # per learner, not per key
            out[:, j] = np.bincount(inverse, per_occurrence[:, j], keys)
            out[:, k + j] = np.bincount(bias, loss[:, j] / cap, keys)
    return out
