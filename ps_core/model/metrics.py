"""Progressive-validation metrics: log loss, AUC and COPC of predictions made
before the model learns from the events."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["logloss", "auc", "copc", "Metrics", "evaluate"]

F64 = npt.NDArray[np.float64]
_EPS = 1e-7


def logloss(p: npt.ArrayLike, y: npt.ArrayLike, w: npt.ArrayLike | None = None) -> float:
    """Mean (weighted) binary log loss; probabilities clipped to [1e-7, 1-1e-7]."""
    pa = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1 - _EPS)
    ya = np.asarray(y, dtype=np.float64)
    loss = -(ya * np.log(pa) + (1 - ya) * np.log1p(-pa))
    weights = None if w is None else np.asarray(w, dtype=np.float64)
    return float(np.average(loss, weights=weights))


def auc(p: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """ROC AUC by ranks (ties get their average rank); NaN with one class only."""
    pa = np.asarray(p, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64) > 0.5
    n_pos = int(ya.sum())
    n_neg = ya.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(pa, kind="mergesort")
    sorted_p = pa[order]
    ranks = np.empty(pa.size, dtype=np.float64)
    # Average rank over runs of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    ends = np.r_[starts[1:], pa.size]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[ya].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def copc(p: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """Clicks over predicted clicks: 1 is calibrated, < 1 over-predicts."""
    s = float(np.sum(p))
    return float(np.sum(y)) / s if s > 0 else float("nan")


@dataclass(frozen=True)
class Metrics:
    """Progressive metrics of one window."""

    events: int
    """Events scored."""
    logloss: float
    """Mean log loss."""
    auc: float
    """ROC AUC (NaN when the window holds one class only)."""
    copc: float
    """Clicks / predicted clicks."""
    ctr: float
    """Observed click rate."""


def evaluate(p: npt.ArrayLike, y: npt.ArrayLike) -> Metrics:
    """All metrics of predictions `p` against labels `y`."""
    pa = np.asarray(p, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if pa.size == 0:
        nan = float("nan")
        return Metrics(0, nan, nan, nan, nan)
    return Metrics(int(pa.size), logloss(pa, ya), auc(pa, ya), copc(pa, ya), float(ya.mean()))
