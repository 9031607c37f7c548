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


def _softplus(z: F64) -> F64:
    """``log(1 + e^z)``, that is ``-log sigmoid(-z)``, finite for every finite z."""
    out: F64 = np.logaddexp(0.0, z)
    return out


def _lse(x: F64) -> F64:
    """(n,) ``log sum_k e^x_k`` of each row, by its largest (one exp a value)."""
    top = x.max(axis=1)
    out: F64 = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return out


def _log_prior(m: F64, cap: float) -> F64:
    """(n, K) log pi of each event's learners, from its bias row's `m`,
    up to a constant per event (the best learner's 0)."""
    a = -cap * m
    a -= a.max(axis=1, keepdims=True)
    return a


def mixed_logits(z: F64, m: F64, cap: float) -> F64:
    """(n,) logits of the mixed probabilities of the learners' logits `z`
    (n, K), each event mixed by `m` (n, K), its bias row's log-weights."""
    log_pi = _log_prior(m, cap)
    down = log_pi - _softplus(z)  # log pi_k + log sigmoid(-z_k)
    out: F64 = _lse(down + z) - _lse(down)
    return out


def pairs_scale(z: F64, m: F64, cap: float) -> F64:
    """(n,) how the mixture's log loss moves with a term every learner's
    logit shares (an FM's pairs), over its dlogit ``p - y``: ``sum_k pi_k
    s_k (1 - s_k) / (p (1 - p))`` with ``s_k = sigmoid(z_k)``. It is in
    [0, 1], and 1 where the learners agree."""
    log_pi = _log_prior(m, cap)
    down = log_pi - _softplus(z)
    up = down + z
    both = _lse(up - _softplus(z))  # log pi_k + log sigmoid(z_k) + log sigmoid(-z_k)
    # pi unnormalised: both, p and q each carry its sum once.
    out: F64 = np.exp(np.minimum(both - _lse(up) - _lse(down) + _lse(log_pi), 0.0))
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
    live = (wt != 0)[:, None]
    out = np.zeros((keys, 2 * k), dtype=np.float32)
    # A logit or a sum past float32's range makes the push not finite, and
    # the caller finds the events behind it (`consumers.training`): no
    # warning for it here.
    with np.errstate(over="ignore", invalid="ignore"):
        soft = _softplus(z)
        # (p_k - y) w per event and learner, and each learner's log loss
        # softplus(z) - y z times w; 0 for an event of weight 0, even where
        # its logits are not finite.
        d = np.where(live, (np.exp(z - soft) - y) * wt[:, None], 0.0)
        loss = np.where(live, (soft - y * z) * wt[:, None], 0.0)
        per_occurrence = d.take(event_of, axis=0)
        per_occurrence *= batch.values.astype(np.float64)[:, None]
        # One bincount for every learner: key i's learner j at i K + j.
        slots = (inverse[:, None] * k + np.arange(k)).ravel()
        out[:, :k] = np.bincount(slots, per_occurrence.ravel(), keys * k).reshape(keys, k)
        bias = bias_rows(batch, inverse)
        if bias.size and (bias == bias[0]).all():  # one model's events: one bias row
            out[bias[0], k:] = loss.sum(axis=0) / cap
        else:
            for j in range(k):  # per learner, not per key
                out[:, k + j] = np.bincount(bias, loss[:, j] / cap, keys)
    return out
