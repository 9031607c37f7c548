"""Models' logits and gradients (against finite differences and a hand-computed
FM), and the progressive metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.hashing import distinct
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.metrics import auc, copc, evaluate, logloss
from ps_core.model.models import FactorizationMachine, LogisticRegression, Model, sigmoid
from ps_core.store.table import SparseTable

EVENTS = [
    {"label": 1, "features": {"a": "x", "b": "y", "n": 0.5}},
    {"label": 0, "features": {"a": "x", "c": "z"}},
    {"label": 1, "features": {"b": "y", "tags": ["p", "q", "p"]}},
]


def _weights(model: Model, keys: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.normal(0, 0.3, size=(keys.size, t.dim)).astype(np.float32) for t in model.tables()}


def _loss(model: Model, batch, plan, weights) -> float:  # type: ignore[no-untyped-def]
    p = sigmoid(model.logits(batch, plan, weights))
    y = batch.labels.astype(np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).sum())


@pytest.mark.parametrize("model", [LogisticRegression("m"), FactorizationMachine("m", k=3)], ids=["lr", "fm"])
def test_gradients_match_finite_differences(model: Model) -> None:
    batch, errors = FeatureHasher("m").featurize(EVENTS)
    assert not errors
    plan = model.plan(batch)
    weights = _weights(model, plan.keys, 1)
    weights = {k: v.astype(np.float64) for k, v in weights.items()}  # type: ignore[misc]
    p = sigmoid(model.logits(batch, plan, weights))
    grads = model.gradients(batch, plan, weights, p - batch.labels)
    eps = 1e-5
    for table, w in weights.items():
        for u in range(w.shape[0]):
            for j in range(w.shape[1]):
                w[u, j] += eps
                up = _loss(model, batch, plan, weights)
                w[u, j] -= 2 * eps
                down = _loss(model, batch, plan, weights)
                w[u, j] += eps
                assert grads[table][u, j] == pytest.approx((up - down) / (2 * eps), rel=1e-3, abs=1e-5)


def test_fm_logit_by_hand() -> None:
    model = FactorizationMachine("m", k=2)
    h = FeatureHasher("m")
    batch, _ = h.featurize([{"label": 1, "features": {"a": "x", "n": 2.0}}])
    plan = model.plan(batch)
    weights = _weights(model, plan.keys, 3)
    w = weights["m_w"][plan.inverse, 0]
    v = weights["m_v"][plan.inverse]
    x = batch.values
    # Occurrence 0 is the bias: linear only. Pairs: only (1, 2).
    expected = w @ x + float(v[1] @ v[2]) * x[1] * x[2]
    assert model.logits(batch, plan, weights)[0] == pytest.approx(expected, rel=1e-5)


def test_lr_learns_with_a_table() -> None:
    """End to end without RPC: pull, gradient, push on a SparseTable."""
    rng = np.random.default_rng(0)
    h, model = FeatureHasher("m"), LogisticRegression("m", {"name": "ftrl", "alpha": 0.5, "l1": 0.0})
    table = SparseTable(model.tables()[0])
    cats = [f"v{i}" for i in range(50)]
    true_w = {c: rng.normal(0, 1.5) for c in cats}

    def events(n: int) -> list[dict[str, object]]:
        out = []
        for _ in range(n):
            c = cats[rng.integers(0, len(cats))]
            out.append({"label": int(rng.random() < 1 / (1 + math.exp(-true_w[c]))), "features": {"f": c}})
        return out

    for _ in range(30):
        batch, _ = h.featurize(events(500))
        plan = model.plan(batch)
        weights = {"m_w": table.pull(plan.keys)}
        p = sigmoid(model.logits(batch, plan, weights))
        table.push(
            plan.keys, model.gradients(batch, plan, weights, p - batch.labels)["m_w"], counts=plan.counts(batch.labels)
        )
    test, _ = h.featurize(events(5000))
    plan = model.plan(test)
    p = sigmoid(model.logits(test, plan, {"m_w": table.pull(plan.keys)}))
    cat_of = {int(h.feature_ids(["f"], [c])[0]): c for c in cats}
    first_feature = test.keys[test.offsets[:-1] + 1]
    bayes = np.array([1 / (1 + math.exp(-true_w[cat_of[int(k)]])) for k in first_feature])
    assert auc(p, test.labels) > auc(bayes, test.labels) - 0.02
    assert abs(copc(p, test.labels) - 1) < 0.1


def test_plan_counts_shows_and_clicks() -> None:
    batch, _ = FeatureHasher("m").featurize(EVENTS)
    plan = LogisticRegression("m").plan(batch)
    counts = plan.counts(batch.labels)
    assert counts[:, 0].sum() == batch.keys.size
    bias = int(np.flatnonzero(plan.keys == FeatureHasher("m").bias_key)[0])
    assert counts[bias].tolist() == [3, 2]
    p_idx = int(np.flatnonzero(plan.keys == FeatureHasher("m").feature_ids(["tags"], ["p"])[0])[0])
    assert counts[p_idx].tolist() == [2, 2]  # multi-hot "p" twice in one clicked event


def test_metrics() -> None:
    y = np.array([0, 0, 1, 1])
    assert auc([0.1, 0.4, 0.35, 0.8], y) == pytest.approx(0.75)
    assert auc([0.5, 0.5, 0.5, 0.5], y) == pytest.approx(0.5)
    assert auc([0.2, 0.3, 0.6, 0.9], y) == 1.0
    assert math.isnan(auc([0.1, 0.2], [1, 1]))
    assert logloss([0.5, 0.5], [0, 1]) == pytest.approx(math.log(2))
    assert copc([0.25, 0.25], [0, 1]) == pytest.approx(2.0)
    m = evaluate([0.2, 0.8], [0, 1])
    assert (m.events, m.auc, m.ctr) == (2, 1.0, 0.5)


@given(
    base=st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=60),
    low=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 10**6), min_size=0, max_size=400),
)
@settings(max_examples=300, deadline=None)
def test_distinct_is_np_unique(base: list[int], low: list[int], picks: list[int]) -> None:
    """Keys drawn with repeats from a pool that includes keys differing only
    in their low 16 bits (the packed sort's blind spot): the same as np.unique."""
    pool = base + [(b & ~0xFFFF) | lo for b in base[:3] for lo in low]
    keys = np.array([pool[i % len(pool)] for i in picks] if pool else [], dtype=np.uint64)
    got_keys, got_inverse = distinct(keys)
    want_keys, want_inverse = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_inverse, want_inverse.reshape(-1))
    assert got_inverse.dtype == np.int64 and got_keys.dtype == np.uint64


def test_distinct_of_more_keys_than_positions_fit() -> None:
    keys = np.random.default_rng(0).integers(0, 2**40, 70_000, dtype=np.uint64)
    got_keys, got_inverse = distinct(keys)
    want_keys, want_inverse = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_inverse, want_inverse)
