"""Optimizers: tiny classes with hyperparameters in ``__init__`` and one
vectorised `step`.

A table row of width ``dim * optimizer.slots`` holds a weight vector and its
optimizer state side by side, ``slots`` blocks of ``dim`` floats, so that one
gather fetches everything an update needs:

=========  ==========================  ====================================
optimizer  row blocks                  weight
=========  ==========================  ====================================
SGD        ``[w]``                     ``w``
AdaGrad    ``[w, G]`` (sum of g²)      ``w``
FTRL       ``[z, n]`` (McMahan 2013)   derived from ``z, n`` on every read
coin       ``[w0, theta, G, L,         derived: ``w0 + (wealth + reward)
           reward]`` (Orabona & Pál    theta / (L (L + G))``
           2016, KT bettor)
ftrl_mix   ``[z, n, m]``, K columns    K FTRL weights, then ``m``: the
           each (K FTRL learners and   mixture's log-weights (each
           the mixture's losses)       learner's loss, in units of `cap`)
=========  ==========================  ====================================

Every optimizer but ``ftrl_mix`` holds ``dim * slots`` floats a row; a
mixture of K learners has weights of width 2K and rows of width 3K
(`Optimizer.width`).

`step` updates gathered rows in place from the (duplicate-summed) gradients;
`weights` reads the weight block; `rows_from_weights` builds the state a fresh
row starts with so that its weight is a given initial value.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import TableConfigError

__all__ = [
    "Optimizer",
    "SGD",
    "AdaGrad",
    "FTRL",
    "CoinBetting",
    "AddDeltas",
    "FTRLMixture",
    "Deriving",
    "ftrl_weights",
    "make_optimizer",
    "OPTIMIZERS",
    "MIN_POSITIVE",
    "MAX_HYPERPARAMETER",
]

MIN_POSITIVE = 1e-12
"""Smallest learning rate, eps or alpha (a rate is divided by)."""
MAX_HYPERPARAMETER = 1e6
"""Largest hyperparameter: the float32 rows stay finite with any of them."""

F32 = npt.NDArray[np.float32]


def ftrl_weights(z: F32, sqrt_n: F32, alpha: np.float32 | F32, beta: float, l1: np.float32 | F32, l2: float) -> F32:
    """FTRL-Proximal's weights from ``z`` and ``sqrt(n)``, a new array;
    `alpha` and `l1` one float32 for every column, or one per column (a
    mixture's learners).

    It computes ``sign(z) max(|z| - l1, 0) / -denom`` with the negated
    denominator ``(-beta - sqrt(n)) / alpha - l2``: IEEE rounding is
    symmetric in sign, so every intermediate is exactly the negation of the
    formula's and the result is the same bits, zeros' signs included, one
    negation fewer.
    """
    neg_denom = np.subtract(np.float32(-beta), sqrt_n)
    neg_denom /= alpha
    neg_denom -= np.float32(l2)
    shrunk = np.abs(z)
    shrunk -= l1
    np.maximum(shrunk, np.float32(0), out=shrunk)
    w: F32 = np.sign(z)
    w *= shrunk
    w /= neg_denom
    return w


class Optimizer(ABC):
    """One update rule. Subclasses set `name` and `slots` and take their
    hyperparameters as keyword arguments (all finite floats)."""

    name: ClassVar[str]
    slots: ClassVar[int]

    def _check_finite(self) -> None:
        # Bounded, not only finite: the rows are float32, and a hyperparameter
        # of 1e300 (or 1e30 with a tiny alpha) makes them infinite at once.
        bad = {k: v for k, v in self.params().items() if not (math.isfinite(v) and abs(v) <= MAX_HYPERPARAMETER)}
        if bad:
            raise TableConfigError(
                f"{self.name} hyperparameters must be finite and at most {MAX_HYPERPARAMETER:g}, got {bad}"
            )

    def params(self) -> dict[str, float]:
        """Hyperparameters, as given to ``__init__``."""
        return {k: float(v) for k, v in vars(self).items()}

    def width(self, dim: int) -> int:
        """State floats in a row of a table of `dim` weights."""
        return dim * self.slots

    def check_dim(self, dim: int) -> str | None:
        """Why a table of `dim` weights cannot have this optimizer, or None."""
        return None

    def spec(self) -> dict[str, Any]:
        """``{"name": ..., **params}``: enough to rebuild it with `make_optimizer`."""
        return {"name": self.name, **self.params()}

    def weights(self, rows: F32, dim: int) -> F32:
        """The weights (n, dim) of rows (n, dim * slots): the first block,
        where SGD and AdaGrad keep them (a view, no copy)."""
        return rows[:, :dim]

    @abstractmethod
    def rows_from_weights(self, w: F32) -> F32:
        """Fresh state rows whose weights are `w` (n, dim)."""

    @abstractmethod
    def step(self, rows: F32, grads: F32) -> None:
        """Apply one update to `rows` (n, dim * slots) in place; grads (n, dim)."""

    def set_weights(self, rows: F32, w: F32) -> None:
        """Make `rows` (n, dim * slots) read as weights `w` (n, dim) in place,
        keeping the rest of their state (a geo worker's copy takes the
        shards' merged weights so, its per-coordinate rates intact)."""
        rows[:, : w.shape[1]] = w


class SGD(Optimizer):
    """Plain stochastic gradient descent with optional L2: ``w -= lr (g + l2 w)``."""

    name = "sgd"
    slots = 1

    def __init__(self, lr: float = 0.05, l2: float = 0.0) -> None:
        if lr < MIN_POSITIVE or l2 < 0:
            raise TableConfigError(f"sgd needs lr >= {MIN_POSITIVE:g} and l2 >= 0")
        self.lr = lr
        self.l2 = l2
        self._check_finite()

    def rows_from_weights(self, w: F32) -> F32:
        return np.array(w, dtype=np.float32, copy=True)

    def step(self, rows: F32, grads: F32) -> None:
        if self.l2:
            grads = grads + np.float32(self.l2) * rows
        rows -= np.float32(self.lr) * grads


class AdaGrad(Optimizer):
    """AdaGrad (Duchi et al. 2011): ``G += g²; w -= lr g / (sqrt(G) + eps)``.

    `initial_accumulator` starts G above zero, damping the first steps."""

    name = "adagrad"
    slots = 2

    def __init__(self, lr: float = 0.05, eps: float = 1e-8, initial_accumulator: float = 0.0) -> None:
        if lr < MIN_POSITIVE or eps < MIN_POSITIVE or initial_accumulator < 0:
            raise TableConfigError(f"adagrad needs lr, eps >= {MIN_POSITIVE:g} and initial_accumulator >= 0")
        self.lr = lr
        self.eps = eps
        self.initial_accumulator = initial_accumulator
        self._check_finite()

    def rows_from_weights(self, w: F32) -> F32:
        out = np.empty((w.shape[0], 2 * w.shape[1]), dtype=np.float32)
        d = w.shape[1]
        out[:, :d] = w
        out[:, d:] = self.initial_accumulator
        return out

    def step(self, rows: F32, grads: F32) -> None:
        d = grads.shape[1]
        w, acc = rows[:, :d], rows[:, d:]
        # acc += g²; w -= (lr g) / (sqrt(acc) + eps), with two temporaries.
        t = grads * grads
        acc += t
        np.sqrt(acc, out=t)
        t += np.float32(self.eps)
        u = np.float32(self.lr) * grads
        u /= t
        w -= u


class FTRL(Optimizer):
    """FTRL-Proximal, per coordinate (McMahan et al. 2013, Algorithm 1).

    State ``z, n``; the weight is ``0`` where ``|z| <= l1``, else
    ``-(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)``. Update with
    gradient g: ``sigma = (sqrt(n + g²) - sqrt(n)) / alpha``,
    ``z += g - sigma w``, ``n += g²``."""

    name = "ftrl"
    slots = 2

    def __init__(self, alpha: float = 0.05, beta: float = 1.0, l1: float = 1.0, l2: float = 1.0) -> None:
        if alpha < MIN_POSITIVE or beta < 0 or l1 < 0 or l2 < 0:
            raise TableConfigError(f"ftrl needs alpha >= {MIN_POSITIVE:g} and beta, l1, l2 >= 0")
        if beta < MIN_POSITIVE and l2 < MIN_POSITIVE:
            # A fresh row's denominator is beta / alpha + l2: 0 divides by zero.
            raise TableConfigError(f"ftrl needs beta or l2 >= {MIN_POSITIVE:g}")
        self.alpha = alpha
        self.beta = beta
        self.l1 = l1
        self.l2 = l2
        self._check_finite()

    def _w(self, z: F32, sqrt_n: F32) -> F32:
        """The weights from z and sqrt(n) (a step computes sqrt(n) once for
        both uses), in place where possible.

        See `ftrl_weights`."""
        return ftrl_weights(z, sqrt_n, np.float32(self.alpha), self.beta, np.float32(self.l1), self.l2)

    def derive(self, rows: F32, dim: int) -> tuple[F32, F32]:
        """The weights (n, dim) of rows and their sqrt(n): what `step` derives
        from the rows before updating them. A caller that has these for rows
        unchanged since can pass them to `step` to spare recomputing them."""
        sqrt_n = np.sqrt(rows[:, dim:])
        return self._w(rows[:, :dim], sqrt_n), sqrt_n

    def weights(self, rows: F32, dim: int) -> F32:
        return self.derive(rows, dim)[0]

    def rows_from_weights(self, w: F32) -> F32:
        # With n = 0 the weight is -(z - sign(z) l1) / (beta/alpha + l2):
        # solve for z so a fresh row reads back exactly its initial weight.
        d = w.shape[1]
        out = np.zeros((w.shape[0], 2 * d), dtype=np.float32)
        denom = np.float32(self.beta / self.alpha + self.l2)
        out[:, :d] = -w * denom - np.sign(w) * np.float32(self.l1)
        return out

    def set_weights(self, rows: F32, w: F32) -> None:
        # Solve z for w with the rows' own n. A zero weight keeps its z
        # (clipped into [-l1, l1], where every z reads as 0), so a feature
        # held at zero by L1 stays where it was.
        d = w.shape[1]
        z, n = rows[:, :d], rows[:, d:]
        denom = (np.float32(self.beta) + np.sqrt(n)) / np.float32(self.alpha) + np.float32(self.l2)
        solved = -w * denom - np.sign(w) * np.float32(self.l1)
        kept = np.clip(z, np.float32(-self.l1), np.float32(self.l1))
        z[...] = np.where(w == 0, kept, solved)

    def step(self, rows: F32, grads: F32, derived: tuple[F32, F32] | None = None) -> None:
        """`Optimizer.step`; `derived`, if given, must be `derive` of `rows`
        as they are now (it is read, not changed)."""
        d = grads.shape[1]
        z, n = rows[:, :d], rows[:, d:]
        w, sqrt_n = self.derive(rows, d) if derived is None else derived
        # n_new = n + g²; sigma = (sqrt(n_new) - sqrt(n)) / alpha;
        # z += g - sigma w; n = n_new (in place, in that order of operations).
        n_new = grads * grads
        np.add(n, n_new, out=n_new)
        sigma = np.sqrt(n_new)
        sigma -= sqrt_n
        sigma /= np.float32(self.alpha)
        sigma *= w
        np.subtract(grads, sigma, out=sigma)
        z += sigma
        n[...] = n_new


class CoinBetting(Optimizer):
    """Parameter-free coin betting, per coordinate, with a Krichevsky–Trofimov
    bettor (Orabona & Pál 2016), scale-free by a running max of ``|g|``.

    State ``[w0, theta, G, L, reward]``: the weight the row started from,
    ``theta = -sum g``, ``G = sum |g|``, ``L = max |g|`` (at least
    `lipschitz`) and ``reward = sum -g bet``. The weight is ``w0 + bet`` with
    ``bet = (wealth + reward) theta / (L (L + G))``, times `scale`. A step
    with gradient g first raises ``L`` to ``|g|``, then bets with the new
    ``L``, so ``|g bet| < wealth + reward`` and the wealth stays positive;
    then ``reward += -g bet; theta -= g; G += |g|``. `wealth` is the
    bettor's initial stake; `scale` shrinks what a row's bet adds to the
    logit (each coordinate bets as if alone, while an event sums tens of
    them: VW's coin divides by the events' mean squared norm likewise), and
    the bettor's wealth counts the unscaled bet; no learning rate."""

    name = "coin"
    slots = 5

    def __init__(self, wealth: float = 4.0, lipschitz: float = 1.0, scale: float = 0.125) -> None:
        if wealth < MIN_POSITIVE or lipschitz < MIN_POSITIVE or scale < MIN_POSITIVE:
            raise TableConfigError(f"coin needs wealth, lipschitz, scale >= {MIN_POSITIVE:g}")
        self.wealth = wealth
        self.lipschitz = lipschitz
        self.scale = scale
        self._check_finite()

    @staticmethod
    def _blocks(rows: F32, dim: int) -> tuple[F32, F32, F32, F32, F32]:
        """Views of the five blocks ``w0, theta, G, L, reward`` of `rows`."""
        return (
            rows[:, :dim],
            rows[:, dim : 2 * dim],
            rows[:, 2 * dim : 3 * dim],
            rows[:, 3 * dim : 4 * dim],
            rows[:, 4 * dim :],
        )

    def _bet(self, theta: F32, g_sum: F32, lip: F32, reward: F32) -> F32:
        """``(wealth + reward) theta / (L (L + G))``, a new array."""
        bet = reward + np.float32(self.wealth)
        bet *= theta
        denom = lip + g_sum
        denom *= lip
        bet /= denom
        return bet

    def weights(self, rows: F32, dim: int) -> F32:
        w0, theta, g_sum, lip, reward = self._blocks(rows, dim)
        w = self._bet(theta, g_sum, lip, reward)
        if self.scale != 1.0:
            w *= np.float32(self.scale)
        w += w0
        return w

    def rows_from_weights(self, w: F32) -> F32:
        d = w.shape[1]
        out = np.zeros((w.shape[0], 5 * d), dtype=np.float32)
        out[:, :d] = w
        out[:, 3 * d : 4 * d] = np.float32(self.lipschitz)
        return out

    def set_weights(self, rows: F32, w: F32) -> None:
        # The betting state stays (the bettor keeps its wealth and scale);
        # only the anchor moves so that the rows read as `w`.
        d = w.shape[1]
        w0, theta, g_sum, lip, reward = self._blocks(rows, d)
        bet = self._bet(theta, g_sum, lip, reward)
        bet *= np.float32(self.scale)
        np.subtract(w, bet, out=w0)

    def step(self, rows: F32, grads: F32) -> None:
        d = grads.shape[1]
        _, theta, g_sum, lip, reward = self._blocks(rows, d)
        abs_g = np.abs(grads)
        np.maximum(lip, abs_g, out=lip)  # the new L first: the bet below is bounded by it
        bet = self._bet(theta, g_sum, lip, reward)  # unscaled: the bettor's own game
        bet *= grads
        reward -= bet
        # |g bet| < wealth + reward in exact arithmetic (|theta| <= G and
        # |g| <= L); float32 rounding could still take the wealth a hair
        # below zero, which would flip the sign of every later bet.
        np.maximum(reward, np.float32(-self.wealth), out=reward)
        theta -= grads
        g_sum += abs_g


class FTRLMixture(Optimizer):
    """K FTRL learners side by side, and the mixture's log-weights.

    A row holds ``[z, n, m]``, K columns each: learner k is FTRL-Proximal
    (`FTRL`) with its own ``alpha_k`` and ``l1_k`` and the shared ``beta``
    and ``l2``. Its weights are the K learners' weights, then ``m``. ``m``
    is what the model mixes the learners by (`ps_core.model.mixture`): each
    learner's progressive log loss, in units of `cap` nats, of which only
    the model's bias row holds any. A push's last K columns are added to
    ``m``; then ``m`` is shifted so that its smallest is 0 and clipped at
    1: a learner `cap` nats behind the best weighs ``e^-cap`` and climbs
    back as soon as it does better (a drift), and the values stay small
    enough for float16 and int8.

    Hyperparameters: ``alpha_i`` and ``l1_i`` for the learners i = 1..K
    (K <= `MAX_LEARNERS`; naming any ``alpha_i`` replaces the default
    learners, and an ``l1_i`` not given is 0.5), ``beta``, ``l2`` and
    ``cap``."""

    name = "ftrl_mix"
    slots = 3  # per learner: z, n, m; `width` counts them
    MAX_LEARNERS: ClassVar[int] = 6
    DEFAULT_LEARNERS: ClassVar[tuple[tuple[float, float], ...]] = (
        (0.05, 0.5),
        (0.1, 0.5),
        (0.2, 0.5),
        (0.35, 0.5),
        (0.35, 5.0),
    )
    """(alpha, l1) of each learner when none is named: chosen by
    `bench/studies/linear_defaults.py` on the tuning half of its streams
    (docs/defaults.md)."""
    DEFAULT_L1: ClassVar[float] = 0.5

    def __init__(self, beta: float = 0.1, l2: float = 1.0, cap: float = 32.0, **learners: float) -> None:
        self.alphas, self.l1s = self._learners(learners)
        if beta < 0 or l2 < 0 or cap < MIN_POSITIVE:
            raise TableConfigError(f"ftrl_mix needs beta, l2 >= 0 and cap >= {MIN_POSITIVE:g}")
        if beta < MIN_POSITIVE and l2 < MIN_POSITIVE:
            raise TableConfigError(f"ftrl_mix needs beta or l2 >= {MIN_POSITIVE:g}")
        self.beta = beta
        self.l2 = l2
        self.cap = cap
        self._check_finite()
        self._alpha = np.array(self.alphas, dtype=np.float32)
        self._l1 = np.array(self.l1s, dtype=np.float32)

    @classmethod
    def _learners(cls, given: dict[str, float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        names = [f"{p}_{i}" for i in range(1, cls.MAX_LEARNERS + 1) for p in ("alpha", "l1")]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TableConfigError(
                f"ftrl_mix has no hyperparameter {', '.join(unknown)}: its learners are alpha_i and l1_i, "
                f"i = 1..{cls.MAX_LEARNERS}, and it has beta, l2 and cap"
            )
        index = sorted(int(k.removeprefix("alpha_")) for k in given if k.startswith("alpha_"))
        orphans = sorted(k for k in given if k.startswith("l1_") and int(k.removeprefix("l1_")) not in index)
        if index and orphans:
            raise TableConfigError(f"ftrl_mix: {', '.join(orphans)} without its alpha_i")
        if not index:
            if orphans:
                raise TableConfigError(f"ftrl_mix: {', '.join(orphans)} without its alpha_i")
            return tuple(a for a, _ in cls.DEFAULT_LEARNERS), tuple(l1 for _, l1 in cls.DEFAULT_LEARNERS)
        if index != list(range(1, len(index) + 1)):
            raise TableConfigError(f"ftrl_mix: its learners are numbered 1..K without gaps, got alpha_{index}")
        alphas = tuple(float(given[f"alpha_{i}"]) for i in index)
        l1s = tuple(float(given.get(f"l1_{i}", cls.DEFAULT_L1)) for i in index)
        if min(alphas) < MIN_POSITIVE or min(l1s) < 0:
            raise TableConfigError(f"ftrl_mix needs every alpha_i >= {MIN_POSITIVE:g} and every l1_i >= 0")
        return alphas, l1s

    @property
    def learners(self) -> int:
        """K: how many FTRL learners it mixes."""
        return len(self.alphas)

    def params(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, (alpha, l1) in enumerate(zip(self.alphas, self.l1s, strict=True), start=1):
            out[f"alpha_{i}"] = alpha
            out[f"l1_{i}"] = l1
        out.update(beta=float(self.beta), l2=float(self.l2), cap=float(self.cap))
        return out

    def width(self, dim: int) -> int:
        return 3 * dim // 2

    def check_dim(self, dim: int) -> str | None:
        k = self.learners
        return None if dim == 2 * k else f"a mixture of {k} learners has {2 * k} weights a row, not {dim}"

    def _split(self, rows: F32) -> tuple[F32, F32, F32]:
        k = self.learners
        return rows[:, :k], rows[:, k : 2 * k], rows[:, 2 * k : 3 * k]

    def _w(self, z: F32, sqrt_n: F32) -> F32:
        """FTRL's weights (`ftrl_weights`), each column at its learner's alpha and l1."""
        return ftrl_weights(z, sqrt_n, self._alpha, self.beta, self._l1, self.l2)

    def derive(self, rows: F32, dim: int) -> tuple[F32, F32]:
        """The weights (n, 2K) of rows and their learners' sqrt(n) (n, K),
        which `step` can be given as `FTRL.derive`'s are."""
        z, n, m = self._split(rows)
        sqrt_n = np.sqrt(n)
        return np.concatenate((self._w(z, sqrt_n), m), axis=1), sqrt_n

    def weights(self, rows: F32, dim: int) -> F32:
        return self.derive(rows, dim)[0]

    def rows_from_weights(self, w: F32) -> F32:
        k = self.learners
        out = np.zeros((w.shape[0], 3 * k), dtype=np.float32)
        denom = np.float32(self.beta) / self._alpha + np.float32(self.l2)
        out[:, :k] = -w[:, :k] * denom - np.sign(w[:, :k]) * self._l1
        out[:, 2 * k :] = w[:, k:]
        return out

    def set_weights(self, rows: F32, w: F32) -> None:
        # As `FTRL.set_weights`, per learner; the log-weights are taken as they are.
        k = self.learners
        z, n, m = self._split(rows)
        denom = (np.float32(self.beta) + np.sqrt(n)) / self._alpha + np.float32(self.l2)
        solved = -w[:, :k] * denom - np.sign(w[:, :k]) * self._l1
        kept = np.clip(z, -self._l1, self._l1)
        z[...] = np.where(w[:, :k] == 0, kept, solved)
        m[...] = w[:, k:]

    def step(self, rows: F32, grads: F32, derived: tuple[F32, F32] | None = None) -> None:
        """`Optimizer.step`; `derived`, if given, must be `derive` of `rows`
        as they are now (it is read, not changed)."""
        k = self.learners
        z, n, m = self._split(rows)
        g = grads[:, :k]
        if derived is None:
            sqrt_n = np.sqrt(n)
            w = self._w(z, sqrt_n)
        else:
            w, sqrt_n = derived[0][:, :k], derived[1]
        n_new = g * g
        np.add(n, n_new, out=n_new)
        sigma = np.sqrt(n_new)
        sigma -= sqrt_n
        sigma /= self._alpha
        sigma *= w
        np.subtract(g, sigma, out=sigma)
        z += sigma
        n[...] = n_new
        # Only the rows whose push carries losses (the bias row, in a
        # model's push) change their log-weights.
        losses = grads[:, k:]
        carried = np.flatnonzero(losses.any(axis=1))
        if carried.size:
            got = m[carried] + losses[carried]
            got -= got.min(axis=1, keepdims=True)
            np.minimum(got, np.float32(1), out=got)
            m[carried] = got


class AddDeltas(Optimizer):
    """The shards' rule for a geo model: rows are weights and a push adds
    its values to them (``w += delta``). Workers train with the model's own
    optimizer on local copies and push parameter differences; not an
    optimizer a table is declared with (`TableConfig.row_rule`)."""

    name = "add"
    slots = 1

    def rows_from_weights(self, w: F32) -> F32:
        return np.array(w, dtype=np.float32, copy=True)

    def step(self, rows: F32, grads: F32) -> None:
        rows += grads


Deriving = FTRL | FTRLMixture
"""The optimizers whose step starts from weights it derives from the rows
(`derive`), which a push right after a pull can take from the pull."""

OPTIMIZERS: dict[str, type[Optimizer]] = {c.name: c for c in (SGD, AdaGrad, FTRL, CoinBetting, FTRLMixture)}


def make_optimizer(spec: dict[str, Any]) -> Optimizer:
    """Build an optimizer from ``{"name": ..., **hyperparameters}``."""
    params = dict(spec)
    name = params.pop("name", None)
    cls = OPTIMIZERS.get(str(name))
    if cls is None:
        raise TableConfigError(f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")
    # Numbers only: float() would also take "0.1" and True.
    wrong = {k: v for k, v in params.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
    if wrong:
        raise TableConfigError(f"{name} hyperparameters must be numbers, got {wrong}")
    try:
        floats = {k: float(v) for k, v in params.items()}
        return cls(**floats)
    except (TypeError, ValueError) as exc:
        raise TableConfigError(f"bad {name} hyperparameters {params}: {exc}") from None
