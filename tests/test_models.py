"""Models' logits and gradients (against finite differences and a hand-computed
FM), and the progressive metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from training import FTRL

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


def _single(model: Model) -> Model:
    """`model` with one FTRL learner: a mixture learner's own model, fed that learner's column."""
    if isinstance(model, FactorizationMachine):
        return FactorizationMachine(model.name, k=model.k, optimizer=FTRL)
    return LogisticRegression(model.name, FTRL)


@pytest.mark.parametrize(
    "model",
    [
        LogisticRegression("m", FTRL),
        FactorizationMachine("m", k=3, optimizer=FTRL),
        LogisticRegression("m"),
        FactorizationMachine("m", k=3),
    ],
    ids=["lr-ftrl", "fm-ftrl", "lr", "fm"],
)
def test_gradients_match_finite_differences(model: Model) -> None:
    """Every gradient against central differences of the loss it descends:
    the model's log loss; for a mixture's learner column (the default
    models) that learner's own log loss, its logit made of its own weights
    (and an FM's pairs, which the learners share); for an FM mixture's
    embeddings the mixture's log loss. A mixture's ``m`` columns are no
    gradient: its learners' losses over `cap` on the bias row."""
    batch, errors = FeatureHasher("m").featurize(EVENTS)
    assert not errors
    plan = model.plan(batch)
    weights = _weights(model, plan.keys, 1)
    weights = {k: v.astype(np.float64) for k, v in weights.items()}  # type: ignore[misc]
    p = sigmoid(model.logits(batch, plan, weights))
    grads = model.gradients(batch, plan, weights, p - batch.labels)
    linear, mixture = f"{model.name}_w", model.mixture
    learners = 0 if mixture is None else mixture.learners
    assert weights[linear].shape[1] == (1 if mixture is None else 2 * learners)

    def loss(table: str, j: int) -> float:
        if table != linear or mixture is None:
            return _loss(model, batch, plan, weights)
        return _loss(_single(model), batch, plan, weights | {linear: weights[linear][:, [j]]})

    eps = 1e-5
    for table, w in weights.items():
        for u in range(w.shape[0]):
            for j in range(w.shape[1] - (learners if table == linear else 0)):
                w[u, j] += eps
                up = loss(table, j)
                w[u, j] -= 2 * eps
                down = loss(table, j)
                w[u, j] += eps
                assert grads[table][u, j] == pytest.approx((up - down) / (2 * eps), rel=1e-3, abs=1e-5)
    if mixture is not None:
        assert learners == 5  # the default mixture's learners
        (bias,) = np.unique(plan.inverse[batch.offsets[:-1]])  # every event's first feature, one row
        for j in range(learners):
            assert grads[linear][bias, learners + j] == pytest.approx(loss(linear, j) / mixture.cap, rel=1e-5)
        assert (np.delete(grads[linear][:, learners:], bias, axis=0) == 0).all()


def test_fm_logit_by_hand() -> None:
    h = FeatureHasher("m")
    batch, _ = h.featurize([{"label": 1, "features": {"a": "x", "n": 2.0}}])
    x = batch.values.astype(np.float64)
    model = FactorizationMachine("m", k=2, optimizer=FTRL)
    plan = model.plan(batch)
    weights = _weights(model, plan.keys, 3)
    w = weights["m_w"][plan.inverse, 0]
    v = weights["m_v"][plan.inverse]
    # Occurrence 0 is the bias: linear only. Pairs: only (1, 2).
    pair = float(v[1] @ v[2]) * x[1] * x[2]
    assert model.logits(batch, plan, weights)[0] == pytest.approx(w @ x + pair, rel=1e-5)
    # The default FM: its 5 learners' logits (same pairs) mixed by the bias
    # row's log-weights m, p = sum_k pi_k sigmoid(z_k), pi_k ∝ exp(-cap m_k).
    default = FactorizationMachine("m", k=2)
    assert default.mixture is not None
    weights = _weights(default, plan.keys, 3)
    weights["m_w"][:, 5:] = np.random.default_rng(4).uniform(0, 0.1, size=(plan.keys.size, 5))
    lw = weights["m_w"][plan.inverse].astype(np.float64)
    v = weights["m_v"][plan.inverse]
    z = x @ lw[:, :5] + float(v[1] @ v[2]) * x[1] * x[2]
    pi = np.exp(-default.mixture.cap * lw[0, 5:])  # occurrence 0 is the bias row
    pi /= pi.sum()
    assert pi.max() < 0.95  # a mixture, not one learner
    expected = float(pi @ (1 / (1 + np.exp(-z))))
    assert sigmoid(default.logits(batch, plan, weights))[0] == pytest.approx(expected, rel=1e-6)


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
