"""The mixture of FTRL learners: its rows against K separate FTRLs, its
mixing against the formula, its gradients against each learner's own, and
a learner that tracks the better of its learners on a stream."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.errors import TableConfigError
from ps_core.model.batch import EventBatch
from ps_core.model.learner import Learner
from ps_core.model.mixture import mixed_logits, pairs_scale
from ps_core.model.models import FactorizationMachine, LogisticRegression
from ps_core.store.optim import FTRL, FTRLMixture, make_optimizer
from ps_core.store.table_config import TableConfig
from ps_core.synthetic import SyntheticStream

LEARNERS = {"alpha_1": 0.05, "l1_1": 0.5, "alpha_2": 0.3, "l1_2": 2.0, "alpha_3": 1.0, "l1_3": 0.0}


def _grads(rng: np.random.Generator, n: int, k: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    return rng.normal(0, 2, size=(n, k)).astype(np.float32)


def test_each_learner_steps_as_an_ftrl_of_its_own_alpha_and_l1() -> None:
    mix = FTRLMixture(beta=0.5, l2=0.3, **LEARNERS)
    singles = [FTRL(alpha=a, beta=0.5, l1=l1, l2=0.3) for a, l1 in zip(mix.alphas, mix.l1s, strict=True)]
    rng = np.random.default_rng(3)
    start = rng.normal(0, 0.3, size=(50, 3)).astype(np.float32)
    rows = mix.rows_from_weights(np.concatenate((start, np.zeros((50, 3), np.float32)), axis=1))
    single_rows = [f.rows_from_weights(start[:, [j]]) for j, f in enumerate(singles)]
    for _ in range(20):
        g = _grads(rng, 50, 3)
        mix.step(rows, np.concatenate((g, np.zeros_like(g)), axis=1))
        for j, f in enumerate(singles):
            f.step(single_rows[j], g[:, [j]])
    w = mix.weights(rows, 6)
    for j, f in enumerate(singles):
        np.testing.assert_array_equal(w[:, j], f.weights(single_rows[j], 1)[:, 0])
        np.testing.assert_array_equal(rows[:, [j, 3 + j]], single_rows[j])
    assert (w[:, 3:] == 0).all()  # no loss pushed: the log-weights stay 0


def test_a_mixture_of_one_learns_as_ftrl_does() -> None:
    events = SyntheticStream(seed=4).batch(3000)
    ftrl = Learner("lr", optimizer={"name": "ftrl", "alpha": 0.2, "beta": 0.1, "l1": 0.5, "l2": 1.0})
    one = Learner("lr", optimizer={"name": "ftrl_mix", "alpha_1": 0.2, "l1_1": 0.5, "beta": 0.1, "l2": 1.0})
    assert one.tables["ctr_w"].config.dim == 2 and one.tables["ctr_w"].width == 3
    a, b = ftrl.learn(events), one.learn(events)
    np.testing.assert_allclose(one.predicted, ftrl.predicted, rtol=1e-9, atol=1e-12)
    assert a.logloss == pytest.approx(b.logloss, rel=1e-9)


def test_losses_pushed_add_up_relative_to_the_best_and_stop_at_the_cap() -> None:
    mix = FTRLMixture(**LEARNERS)
    rows = mix.rows_from_weights(np.zeros((1, 6), np.float32))
    push = np.zeros((1, 6), np.float32)
    push[0, 3:] = [0.25, 0.5, 0.125]
    mix.step(rows, push)
    np.testing.assert_array_equal(mix.weights(rows, 6)[0, 3:], [0.125, 0.375, 0.0])  # the best at 0
    push[0, 3:] = [0.0, 2.0, 0.5]
    mix.step(rows, push)
    np.testing.assert_array_equal(mix.weights(rows, 6)[0, 3:], [0.0, 1.0, 0.375])  # capped at 1


def test_weights_read_back_as_written() -> None:
    mix = FTRLMixture(**LEARNERS)
    rng = np.random.default_rng(5)
    w = rng.normal(0, 1, size=(40, 6)).astype(np.float32)
    w[:, 3:] = np.abs(w[:, 3:]) / 4
    w[::3, :3] = 0
    np.testing.assert_allclose(mix.weights(mix.rows_from_weights(w), 6), w, rtol=1e-5, atol=1e-6)
    rows = mix.rows_from_weights(np.zeros_like(w))
    for _ in range(5):
        mix.step(rows, np.concatenate((_grads(rng, 40, 3), np.zeros((40, 3), np.float32)), axis=1))
    n_before = rows[:, 3:6].copy()
    mix.set_weights(rows, w)
    np.testing.assert_allclose(mix.weights(rows, 6), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rows[:, 3:6], n_before)  # the learners keep their rates


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"alpha_1": 0.1, "l1_2": 1.0}, "l1_2 without its alpha_i"),
        ({"l1_1": 1.0}, "l1_1 without its alpha_i"),
        ({"alpha_1": 0.1, "alpha_3": 0.2}, "numbered 1..K without gaps"),
        ({"alpha_7": 0.1}, "no hyperparameter alpha_7"),
        ({"lr": 0.1}, "no hyperparameter lr"),
        ({"alpha_1": 0.0}, "every alpha_i >= "),
        ({"alpha_1": 0.1, "l1_1": -1.0}, "every l1_i >= 0"),
        ({"beta": 0.0, "l2": 0.0}, "beta or l2"),
        ({"cap": 0.0}, "cap >= "),
        ({"alpha_1": math.inf}, "finite"),
    ],
)
def test_a_bad_mixture_is_refused_with_its_reason(spec: dict[str, float], why: str) -> None:
    with pytest.raises(TableConfigError, match=why):
        make_optimizer({"name": "ftrl_mix", **spec})


def test_a_mixture_table_has_two_columns_a_learner() -> None:
    with pytest.raises(TableConfigError, match="table t: a mixture of 5 learners has 10 weights a row, not 1"):
        TableConfig("t", 1, {"name": "ftrl_mix"})
    # The default learners: alpha 0.05, 0.1, 0.2, 0.35 at l1 0.5 and alpha 0.35 at l1 5.
    assert TableConfig("t", 10, {"name": "ftrl_mix"}).optimizer == {
        "name": "ftrl_mix",
        **{"alpha_1": 0.05, "l1_1": 0.5, "alpha_2": 0.1, "l1_2": 0.5, "alpha_3": 0.2, "l1_3": 0.5},
        **{"alpha_4": 0.35, "l1_4": 0.5, "alpha_5": 0.35, "l1_5": 5.0, "beta": 0.1, "l2": 1.0, "cap": 32.0},
    }
    spec = TableConfig("t", 4, {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.2}).optimizer
    assert spec == {"name": "ftrl_mix", "alpha_1": 0.1, "l1_1": 0.5, "alpha_2": 0.2, "l1_2": 0.5}.copy() | {
        "beta": 0.1,
        "l2": 1.0,
        "cap": 32.0,
    }


def _sigmoid(z: np.ndarray[Any, np.dtype[np.float64]]) -> np.ndarray[Any, np.dtype[np.float64]]:
    out: np.ndarray[Any, np.dtype[np.float64]] = 1 / (1 + np.exp(-z))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
    st.floats(0.5, 64),
)
def test_mixed_logits_are_the_mixture_of_the_learners_probabilities(k: int, seed: int, cap: float) -> None:
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 4, size=(30, k))
    m = rng.uniform(0, 1, size=(30, k))
    pi = np.exp(-cap * m)
    pi /= pi.sum(axis=1, keepdims=True)
    p = (pi * _sigmoid(z)).sum(axis=1)
    np.testing.assert_allclose(_sigmoid(mixed_logits(z, m, cap)), p, rtol=1e-9, atol=1e-12)


def test_mixed_logits_stay_finite_and_follow_a_learner_far_ahead() -> None:
    z = np.array([[800.0, -800.0], [-4.0, 3.0], [2.0, -1.0]])
    m = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    got = mixed_logits(z, m, 32.0)
    assert np.isfinite(got).all()
    assert got[0] == pytest.approx(0.0, abs=1e-9)  # certain both ways: an even mixture
    assert got[1] == pytest.approx(-4.0, abs=1e-6)  # learner 2 is 32 nats behind
    assert got[2] == pytest.approx(-1.0, abs=1e-6)


def _batch(rng: np.random.Generator, n: int, keys: int) -> EventBatch:
    per = rng.integers(1, 5, size=n)  # features after the bias
    offsets = np.concatenate(([0], np.cumsum(per + 1))).astype(np.int64)
    nnz = int(offsets[-1])
    ids = rng.integers(1, keys, size=nnz).astype(np.uint64)
    ids[offsets[:-1]] = 0  # each event's bias first
    values = rng.normal(1, 0.5, size=nnz).astype(np.float32)
    values[offsets[:-1]] = 1
    return EventBatch(
        keys=ids,
        values=values,
        offsets=offsets,
        labels=(rng.random(n) < 0.3).astype(np.float32),
        weights=rng.uniform(0.5, 2, size=n).astype(np.float32),
        ts=np.zeros(n),
        index=np.arange(n, dtype=np.int64),
    )


def test_each_learner_gets_its_own_gradient_and_the_bias_row_its_loss() -> None:
    rng = np.random.default_rng(9)
    batch = _batch(rng, 40, 12)
    batch.weights[5] = 0  # an event left out (masked): no gradient, no loss
    model = LogisticRegression("m", {"name": "ftrl_mix", **LEARNERS})
    plan = model.plan(batch)
    table = rng.normal(0, 0.5, size=(plan.keys.size, 6)).astype(np.float32)
    table[:, 3:] = rng.uniform(0, 1, size=(plan.keys.size, 3))
    grads = model.gradients(batch, plan, {"m_w": table}, np.zeros(40))["m_w"]
    bias = int(np.flatnonzero(plan.keys == 0)[0])
    ev = batch.event_of_feature()
    y, wt = batch.labels.astype(np.float64), batch.weights.astype(np.float64)
    for j in range(3):
        z = np.bincount(ev, table[plan.inverse, j] * batch.values, 40)
        d = (_sigmoid(z) - y) * wt
        want = np.bincount(plan.inverse, d[ev] * batch.values, plan.keys.size)
        np.testing.assert_allclose(grads[:, j], want, rtol=1e-5, atol=1e-5)
        loss = -(y * np.log(_sigmoid(z)) + (1 - y) * np.log(1 - _sigmoid(z))) * wt
        assert grads[bias, 3 + j] == pytest.approx(loss.sum() / 32.0, rel=1e-5)
    assert (np.delete(grads[:, 3:], bias, axis=0) == 0).all()
    # The event of weight 0 took no part: its label changes nothing.
    batch.labels[5] = 1 - batch.labels[5]
    again = model.gradients(batch, plan, {"m_w": table}, np.zeros(40))["m_w"]
    np.testing.assert_array_equal(again, grads)


def test_a_mixture_tracks_the_better_of_its_learners() -> None:
    """A mixture of a good learner and one whose alpha is far too large
    scores within log 2 nats (the Bayes mixture's bound) and a little
    mini-batch lag of the good one alone, where an even average of the two
    would not."""
    events = SyntheticStream(seed=21).batch(12000)
    good = {"alpha_1": 0.1, "l1_1": 0.5}
    bad = {"alpha_2": 30.0, "l1_2": 0.0}
    results = {}
    for name, spec in (("good", good), ("bad", {"alpha_1": 30.0, "l1_1": 0.0}), ("mix", good | bad)):
        learner = Learner("lr", optimizer={"name": "ftrl_mix", **spec})
        results[name] = learner.learn(events).logloss * len(events)  # total nats
    assert results["bad"] > results["good"] + 200  # the two learners differ a lot
    assert results["mix"] <= results["good"] + math.log(2) + 0.002 * results["good"], results


def test_fm_learners_share_the_pairs() -> None:
    model = FactorizationMachine("f", k=2, optimizer={"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.2})
    assert [t.dim for t in model.tables()] == [4, 2]
    rng = np.random.default_rng(2)
    batch = _batch(rng, 20, 9)
    plan = model.plan(batch)
    w = rng.normal(0, 0.3, size=(plan.keys.size, 4)).astype(np.float32)
    w[:, 2:] = 0  # equal log-weights: an even mixture
    v = rng.normal(0, 0.3, size=(plan.keys.size, 2)).astype(np.float32)
    got = model.logits(batch, plan, {"f_w": w, "f_v": v})
    alone = FactorizationMachine("f", k=2, optimizer={"name": "ftrl"})
    ev = batch.event_of_feature()
    probabilities = []
    for j in range(2):
        lin = np.bincount(ev, w[plan.inverse, j] * batch.values, 20)
        pairs = alone.logits(batch, plan, {"f_w": np.zeros((plan.keys.size, 1), np.float32), "f_v": v})
        probabilities.append(_sigmoid(lin + pairs))
    np.testing.assert_allclose(_sigmoid(got), np.mean(probabilities, axis=0), rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_the_pairs_move_the_mixture_by_its_learners_slopes(k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, size=(25, k))
    m = rng.uniform(0, 1, size=(25, k))
    pi = np.exp(-32.0 * m)
    pi /= pi.sum(axis=1, keepdims=True)
    s = _sigmoid(z)
    p = (pi * s).sum(axis=1)
    got = pairs_scale(z, m, 32.0)
    np.testing.assert_allclose(got, (pi * s * (1 - s)).sum(axis=1) / (p * (1 - p)), rtol=1e-7)
    assert ((got >= 0) & (got <= 1)).all()
    np.testing.assert_allclose(pairs_scale(np.repeat(z[:, :1], k, axis=1), m, 32.0), 1.0, rtol=1e-9)
