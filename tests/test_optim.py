"""Every optimizer's vectorised step against a scalar, per-coordinate reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.errors import TableConfigError
from ps_core.store.optim import FTRL, SGD, AdaGrad, CoinBetting, Optimizer, make_optimizer
from ps_core.store.table import SparseTable

# A scalar reference updates one coordinate's state (a dict) with one gradient
from ps_core.store.table_config import TableConfig

# A scalar reference updates one coordinate's state (a dict) with one gradient
# and returns its weight, written straight from the papers' formulas.
Scalar = Callable[[dict[str, float], float], None]


def sgd_ref(lr: float, l2: float) -> tuple[Callable[[dict[str, float]], float], Scalar]:
    def w(s: dict[str, float]) -> float:
        return s["w"]

    def step(s: dict[str, float], g: float) -> None:
        s["w"] -= lr * (g + l2 * s["w"])

    return w, step


def adagrad_ref(lr: float, eps: float) -> tuple[Callable[[dict[str, float]], float], Scalar]:
    def w(s: dict[str, float]) -> float:
        return s["w"]

    def step(s: dict[str, float], g: float) -> None:
        s["G"] += g * g
        s["w"] -= lr * g / (math.sqrt(s["G"]) + eps)

    return w, step


def ftrl_ref(alpha: float, beta: float, l1: float, l2: float) -> tuple[Callable[[dict[str, float]], float], Scalar]:
    """McMahan et al. 2013, Algorithm 1, one coordinate."""

    def w(s: dict[str, float]) -> float:
        z, n = s["z"], s["n"]
        if abs(z) <= l1:
            return 0.0
        sign = 1.0 if z > 0 else -1.0
        return -(z - sign * l1) / ((beta + math.sqrt(n)) / alpha + l2)

    def step(s: dict[str, float], g: float) -> None:
        wt = w(s)
        sigma = (math.sqrt(s["n"] + g * g) - math.sqrt(s["n"])) / alpha
        s["z"] += g - sigma * wt
        s["n"] += g * g

    return w, step


def coin_ref(wealth: float, lipschitz: float, scale: float = 1.0) -> tuple[Callable[[dict[str, float]], float], Scalar]:
    """Coin betting with a KT bettor (Orabona & Pál 2016), one coordinate,
    the scale L a running max of |g| floored at `lipschitz`; the weight
    takes `scale` times the bet, the wealth the whole bet."""

    def bet(s: dict[str, float]) -> float:
        return (wealth + s["reward"]) * s["theta"] / (s["L"] * (s["L"] + s["G"]))

    def w(s: dict[str, float]) -> float:
        return s["w0"] + scale * bet(s)

    def step(s: dict[str, float], g: float) -> None:
        s["L"] = max(s["L"], abs(g))
        s["reward"] = max(s["reward"] - g * bet(s), -wealth)
        s["theta"] -= g
        s["G"] += abs(g)

    return w, step


CASES = [
    pytest.param(SGD(lr=0.1, l2=0.01), sgd_ref(0.1, 0.01), {"w": 0.0}, id="sgd"),
    pytest.param(AdaGrad(lr=0.3, eps=1e-6), adagrad_ref(0.3, 1e-6), {"w": 0.0, "G": 0.0}, id="adagrad"),
    pytest.param(
        FTRL(alpha=0.5, beta=1.0, l1=0.3, l2=0.2), ftrl_ref(0.5, 1.0, 0.3, 0.2), {"z": 0.0, "n": 0.0}, id="ftrl"
    ),
    pytest.param(
        FTRL(alpha=0.1, beta=0.5, l1=0.0, l2=0.0), ftrl_ref(0.1, 0.5, 0.0, 0.0), {"z": 0.0, "n": 0.0}, id="ftrl-no-reg"
    ),
    pytest.param(
        CoinBetting(),
        coin_ref(4.0, 1.0, 0.125),
        {"w0": 0.0, "theta": 0.0, "G": 0.0, "L": 1.0, "reward": 0.0},
        id="coin",
    ),
    pytest.param(
        CoinBetting(wealth=3.0, lipschitz=0.05),
        coin_ref(3.0, 0.05, 0.125),
        {"w0": 0.0, "theta": 0.0, "G": 0.0, "L": 0.05, "reward": 0.0},
        id="coin-low-floor",
    ),
    pytest.param(
        CoinBetting(wealth=4.0, lipschitz=1.0, scale=0.025),
        coin_ref(4.0, 1.0, 0.025),
        {"w0": 0.0, "theta": 0.0, "G": 0.0, "L": 1.0, "reward": 0.0},
        id="coin-scaled",
    ),
]


@pytest.mark.parametrize("opt, ref, init", CASES)
def test_step_matches_scalar_reference(
    opt: Optimizer,
    ref: tuple[Callable[[dict[str, float]], float], Scalar],
    init: dict[str, float],
) -> None:
    ref_w, ref_step = ref
    rng = np.random.default_rng(11)
    n, dim, steps = 40, 3, 25
    rows = opt.rows_from_weights(np.zeros((n, dim), dtype=np.float32))
    states = [[dict(init) for _ in range(dim)] for _ in range(n)]
    for _ in range(steps):
        grads = (rng.normal(size=(n, dim)) * rng.choice([0.1, 1.0, 5.0])).astype(np.float32)
        opt.step(rows, grads)
        for i in range(n):
            for j in range(dim):
                ref_step(states[i][j], float(grads[i, j]))
        expected = np.array([[ref_w(states[i][j]) for j in range(dim)] for i in range(n)])
        np.testing.assert_allclose(opt.weights(rows, dim), expected, rtol=2e-4, atol=2e-6)


def test_ftrl_closed_form_weight() -> None:
    """w = 0 inside the L1 ball, else -(z - sign(z) l1) / ((beta + sqrt n)/alpha + l2)."""
    opt = FTRL(alpha=0.2, beta=1.0, l1=1.5, l2=0.5)
    z = np.array([[-3.0], [-1.5], [0.0], [1.0], [1.5000001], [4.0]], dtype=np.float32)
    n = np.array([[4.0], [1.0], [0.0], [9.0], [0.0], [16.0]], dtype=np.float32)
    w = opt.weights(np.hstack([z, n]), 1)[:, 0]
    expected = [
        -(-3.0 + 1.5) / ((1.0 + 2.0) / 0.2 + 0.5),
        0.0,
        0.0,
        0.0,
        -(1.5000001 - 1.5) / (1.0 / 0.2 + 0.5),
        -(4.0 - 1.5) / ((1.0 + 4.0) / 0.2 + 0.5),
    ]
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "spec",
    [{"name": "sgd"}, {"name": "adagrad", "initial_accumulator": 0.1}, {"name": "ftrl"}, {"name": "coin", "wealth": 2}],
)
def test_rows_from_weights_read_back(spec: dict[str, object]) -> None:
    opt = make_optimizer(dict(spec))
    w = np.array([[0.0, 0.25, -0.5], [1e-3, -2.0, 3.0]], dtype=np.float32)
    np.testing.assert_allclose(opt.weights(opt.rows_from_weights(w), 3), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "sgd", "lr": 0.1},
        {"name": "adagrad", "lr": 0.2},
        {"name": "ftrl", "alpha": 0.3, "l1": 0.1},
        {"name": "coin", "wealth": 0.5, "lipschitz": 0.2},
    ],
)
def test_push_sums_duplicate_gradients_before_one_step(spec: dict[str, object]) -> None:
    """A push naming a key three times equals one step with the summed gradient
    (not three steps)."""
    table = SparseTable(TableConfig("t", 2, dict(spec)))
    keys = np.array([7, 9, 7, 7, 2**64 - 1], dtype=np.uint64)
    grads = np.array([[1, 2], [0.5, 0.5], [0.25, -1], [-0.5, 3], [2, 2]], dtype=np.float32)
    table.push(keys, grads)
    opt = make_optimizer(dict(spec))
    rows = opt.rows_from_weights(np.zeros((3, 2), dtype=np.float32))
    summed = np.array([grads[[0, 2, 3]].sum(0), grads[1], grads[4]], dtype=np.float32)
    opt.step(rows, summed)
    got = table.pull(np.array([7, 9, 2**64 - 1], dtype=np.uint64))
    np.testing.assert_allclose(got, opt.weights(rows, 2), rtol=1e-6)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "ftrl", "alpha": -1},
        {"name": "adam"},
        {"name": "sgd", "momentum": 0.9},
        {"name": "coin", "wealth": -1},
        {"name": "coin", "wealth": 0},
        {"name": "coin", "lipschitz": 0},
        {"name": "coin", "wealth": 1e30},
        {"name": "coin", "wealth": float("nan")},
        {"name": "coin", "lr": 0.1},
        {"name": "coin", "wealth": "2"},
    ],
)
def test_bad_hyperparameters_are_config_errors(spec: dict[str, object]) -> None:
    with pytest.raises(TableConfigError):
        make_optimizer(spec)


def test_coin_defaults_and_spec() -> None:
    assert make_optimizer({"name": "coin"}).spec() == {"name": "coin", "wealth": 4.0, "lipschitz": 1.0, "scale": 0.125}
    assert CoinBetting.slots == 5


def test_bad_hyperparameters_of_the_others_are_config_errors() -> None:
    with pytest.raises(TableConfigError):
        make_optimizer({"name": "ftrl", "alpha": -1})
    with pytest.raises(TableConfigError):
        make_optimizer({"name": "adam"})
    with pytest.raises(TableConfigError):
        make_optimizer({"name": "sgd", "momentum": 0.9})


def _ftrl_formula(opt: FTRL, rows: np.ndarray, d: int) -> np.ndarray:
    """The weight as the docstring writes it, in float32 (no in-place tricks)."""
    z, n = rows[:, :d], rows[:, d:]
    denom = (np.float32(opt.beta) + np.sqrt(n)) / np.float32(opt.alpha) + np.float32(opt.l2)
    shrunk = np.abs(z) - np.float32(opt.l1)
    w: np.ndarray = -np.sign(z) * np.maximum(shrunk, np.float32(0)) / denom
    return w


@pytest.mark.parametrize(
    "params",
    [
        dict(alpha=0.05, beta=1.0, l1=1.0, l2=1.0),
        dict(alpha=0.1, beta=0.5, l1=0.0, l2=0.0),
        dict(alpha=1.7, beta=0.01, l1=3.0, l2=0.2),
    ],
)
def test_ftrl_weights_and_steps_are_the_formulas_bit_for_bit(params: dict[str, float]) -> None:
    """The in-place arithmetic (and the negated denominator) gives the very
    bits of the plain formulas, zeros' signs included (fresh rows hold
    z = -0.0); a step given `derive`'s output equals one deriving itself."""
    opt = FTRL(**params)
    rng = np.random.default_rng(3)
    n, d = 4000, 2
    z = (rng.normal(size=(n, d)) * 10.0 ** rng.uniform(-6, 2, (n, d))).astype(np.float32)
    z[:8] = [[0.0, -0.0]] * 8
    acc = (np.abs(rng.normal(size=(n, d))) * 10.0 ** rng.uniform(-6, 4, (n, d))).astype(np.float32)
    acc[:4] = 0.0
    rows = np.hstack([z, acc])
    fresh = opt.rows_from_weights(np.zeros((3, d), dtype=np.float32))
    assert np.signbit(fresh[:, :d]).all()  # -0.0: what the bit-exactness must preserve
    rows = np.vstack([rows, fresh])
    assert opt.weights(rows, d).view(np.uint32).tolist() == _ftrl_formula(opt, rows, d).view(np.uint32).tolist()
    grads = rng.normal(size=(rows.shape[0], d)).astype(np.float32)
    grads[:2] = 0.0
    expect = rows.copy()
    w = _ftrl_formula(opt, expect, d)
    zz, nn = expect[:, :d], expect[:, d:]
    n_new = nn + grads * grads
    sigma = (np.sqrt(n_new) - np.sqrt(nn)) / np.float32(opt.alpha)
    zz += grads - sigma * w
    nn[...] = n_new
    plain, given = rows.copy(), rows.copy()
    opt.step(plain, grads)
    opt.step(given, grads, opt.derive(given, d))
    assert plain.view(np.uint32).tolist() == expect.view(np.uint32).tolist()
    assert given.view(np.uint32).tolist() == expect.view(np.uint32).tolist()


def test_adagrad_step_is_the_formula_bit_for_bit() -> None:
    opt = AdaGrad(lr=0.3, eps=1e-6, initial_accumulator=0.1)
    rng = np.random.default_rng(4)
    rows = opt.rows_from_weights(rng.normal(size=(500, 4)).astype(np.float32))
    grads = rng.normal(size=(500, 4)).astype(np.float32)
    expect = rows.copy()
    w, acc = expect[:, :4], expect[:, 4:]
    acc += grads * grads
    w -= np.float32(opt.lr) * grads / (np.sqrt(acc) + np.float32(opt.eps))
    opt.step(rows, grads)
    assert rows.view(np.uint32).tolist() == expect.view(np.uint32).tolist()


def test_coin_matches_its_scalar_reference_over_long_runs_with_big_and_zero_gradients() -> None:
    """Many steps; gradients far above the floor (L must grow), exact zeros,
    and a drifting sign so the bettor both wins and loses."""
    opt = CoinBetting(wealth=1.5, lipschitz=0.5, scale=0.3)
    ref_w, ref_step = coin_ref(1.5, 0.5, 0.3)
    rng = np.random.default_rng(21)
    n, dim, steps = 12, 2, 300
    w_init = rng.normal(size=(n, dim)).astype(np.float32)
    rows = opt.rows_from_weights(w_init)
    states = [
        [{"w0": float(w_init[i, j]), "theta": 0.0, "G": 0.0, "L": 0.5, "reward": 0.0} for j in range(dim)]
        for i in range(n)
    ]
    bias = rng.normal(size=(n, dim))
    for t in range(steps):
        scale = [0.01, 0.3, 1.0, 4.0, 40.0][t % 5]
        grads = ((rng.normal(size=(n, dim)) + bias) * scale).astype(np.float32)
        grads[rng.random((n, dim)) < 0.2] = 0.0
        opt.step(rows, grads)
        for i in range(n):
            for j in range(dim):
                ref_step(states[i][j], float(grads[i, j]))
        want = np.array([[ref_w(states[i][j]) for j in range(dim)] for i in range(n)])
        np.testing.assert_allclose(opt.weights(rows, dim), want, rtol=2e-3, atol=2e-5)
    assert rows.dtype == np.float32
    # The state blocks are the reference's too: theta, G, L, reward.
    for block, key in enumerate(["theta", "G", "L", "reward"], start=1):
        got = rows[:, block * dim : (block + 1) * dim]
        want = np.array([[states[i][j][key] for j in range(dim)] for i in range(n)])
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    wealth=st.floats(1e-3, 1e3),
    lipschitz=st.floats(1e-6, 1e3),
    grads=st.lists(
        st.one_of(st.just(0.0), st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False)),
        min_size=1,
        max_size=60,
    ),
)
def test_coin_wealth_stays_positive_under_adversarial_gradients(
    wealth: float, lipschitz: float, grads: list[float]
) -> None:
    """Whatever the gradients (huge, tiny, sign flips chasing the bet), the
    bettor's wealth never goes negative and every stored float stays finite."""
    opt = CoinBetting(wealth=wealth, lipschitz=lipschitz)
    rows = opt.rows_from_weights(np.zeros((2, 1), dtype=np.float32))
    for g in grads:
        # Row 0 takes the gradient as drawn; row 1 the one that loses most
        # against its current bet (the sign of the bet: an adversary).
        bet = float(opt.weights(rows[1:2], 1)[0, 0])
        adversary = abs(g) if bet > 0 else -abs(g)
        opt.step(rows, np.array([[g], [adversary]], dtype=np.float32))
        reward = rows[:, 4]
        assert (np.float32(wealth) + reward >= 0).all()
        assert np.isfinite(rows).all()
        assert np.isfinite(opt.weights(rows, 1)).all()


def test_coin_set_weights_keeps_the_betting_state() -> None:
    opt = CoinBetting(wealth=2.0, lipschitz=0.3)
    rng = np.random.default_rng(5)
    rows = opt.rows_from_weights(rng.normal(size=(50, 3)).astype(np.float32))
    for _ in range(20):
        opt.step(rows, rng.normal(size=(50, 3)).astype(np.float32))
    state = rows[:, 3:].copy()
    target = rng.normal(size=(50, 3)).astype(np.float32)
    opt.set_weights(rows, target)
    np.testing.assert_allclose(opt.weights(rows, 3), target, rtol=1e-5, atol=1e-6)
    assert rows[:, 3:].tobytes() == state.tobytes()  # theta, G, L, reward untouched
    fresh = opt.rows_from_weights(target)
    assert (fresh[:, 3:9] == 0).all() and (fresh[:, 9:12] == np.float32(0.3)).all() and (fresh[:, 12:] == 0).all()


def test_coin_rounding_never_takes_the_wealth_below_zero() -> None:
    """With theta = G far above L (as after very many same-sign gradients of
    size L) a gradient of size L against the bet loses the whole wealth in
    exact arithmetic less a hair that float32 rounds away: the loss can come
    out a rounding above the wealth. The clip holds the wealth at 0 (without
    it some 3 % of these stakes go negative)."""
    wealth = np.random.default_rng(0).uniform(0.01, 100, 2000).astype(np.float32)
    for w in wealth:
        opt = CoinBetting(wealth=float(w), lipschitz=1.0)
        rows = opt.rows_from_weights(np.zeros((1, 1), np.float32))
        rows[0, 1] = rows[0, 2] = np.float32(3e8)  # theta, G
        opt.step(rows, np.ones((1, 1), np.float32))
        assert w + rows[0, 4] >= 0, (w, rows)
