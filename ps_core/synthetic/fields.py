"""Declared fields of a synthetic stream and the hidden model built over them.

A stream declared field by field (`SyntheticStream(categorical_fields=...)`)
draws each categorical field's value ranks from its own Zipf law over its own
cardinality, and each count field from its own lognormal; values may be
missing, derived from another field's, or the hour of day. The hidden logistic
model over them is::

    logit = bias + s · (Σ_f w_f(rank_f) + Σ_pairs g·⟨u_a(rank_a), u_b(rank_b)⟩
                        + Σ_j c_j·z(I_j) + A·cos(2π (hour − peak) / 24))

Nothing here holds a table as long as a field's cardinality: ranks below
`HEAD` have an explicit probability table, ranks above it are drawn from the
continuous power law's inverse, and every per-value weight (``w``, and the
pair factors ``u``) is a normal draw derived by hashing (key, field, rank), so
a field of ten million values costs the same memory as one of ten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["HEAD", "CategoricalField", "FieldModel", "NumericField", "Pair"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

HEAD = 4096
"""Ranks per field with an explicit probability (the rest follow the power law's inverse)."""

# A value's weight std by its rank k: ((k + 1) / (k + 1 + _HEAD_K)) ** _HEAD_POW
# · (1 + k / _RANK_K0) ** -_RANK_POW. The most frequent values (a default, a portal)
# click near the average and carry little; the rare ones shrink mildly; so most
# of the signal sits on values seen tens to thousands of times in a million events.
_HEAD_K = 10.0
_HEAD_POW = 0.5
_RANK_K0 = 100.0
_RANK_POW = 0.2
_PAIR_DIM = 4  # latent factors per value in a pairwise interaction (what an FM can find)
_NUM_STD = 0.08  # std of a count field's effect before the signal scale, per unit of its weight
_HOUR_PEAK = 20.0  # hour of day (UTC) of the daily cycle's highest click rate
_CALIBRATION_EVENTS = 32_768


@dataclass(frozen=True)
class CategoricalField:
    """One categorical field: `cardinality` values ranked by a Zipf law of exponent `zipf_a`.

    - `missing`: probability the field is absent from an event;
    - `head`: probability of rank 0 beyond its Zipf share (one dominant value,
      as Avazu's ``device_id``); the other ranks follow the Zipf law;
    - `parent`, `parent_share`: with that probability the value is a fixed
      function of the named field's value (a site's domain), else drawn anew;
    - `hour`: the value is the hour of day of the event's ``ts`` ("00".."23");
    - `weight`: the field's share of the signal (its weights' relative std).
    """

    name: str
    cardinality: int
    zipf_a: float = 1.1
    missing: float = 0.0
    head: float = 0.0
    parent: str | None = None
    parent_share: float = 0.0
    hour: bool = False
    weight: float = 1.0


@dataclass(frozen=True)
class NumericField:
    """One count field: ``floor(exp(mu + sigma·N(0, 1)))``, absent with
    probability `missing`, and with probability `negative` a small negative
    count (−1 to −3) instead; `weight` scales its effect on the logit."""

    name: str
    mu: float
    sigma: float
    missing: float = 0.0
    negative: float = 0.0
    weight: float = 1.0


@dataclass(frozen=True)
class Pair:
    """A pairwise interaction ``strength · ⟨u_a, u_b⟩`` between two categorical
    fields, each value with a hashed latent vector: the form an FM learns."""

    a: str
    b: str
    strength: float


def _fmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """MurmurHash3's 64-bit finaliser: a bijection with full avalanche."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


def _hash(key: int, fields: I64, ranks: I64) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of (key, field, rank), elementwise over broadcast arrays."""
    with np.errstate(over="ignore"):
        x = (fields.astype(np.uint64) << np.uint64(40)) ^ ranks.astype(np.uint64)
        return _fmix64(_fmix64(x ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF)))


def _unit(h: npt.NDArray[np.uint64]) -> F64:
    """Uniform in (0, 1) from a hash's top 53 bits."""
    out: F64 = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return out


def hashed_normal(key: int, fields: I64, ranks: I64) -> F64:
    """A standard normal draw per (key, field, rank) (Box-Muller on two hashes)."""
    h = _hash(key, fields, ranks)
    u1 = _unit(h)
    u2 = _unit(_fmix64(h ^ np.uint64(0x9E3779B97F4A7C15)))
    out: F64 = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    return out


def _rank_std(ranks: I64) -> F64:
    """The weight std of each rank (see `_HEAD_K`)."""
    k = ranks.astype(np.float64)
    out: F64 = ((k + 1.0) / (k + 1.0 + _HEAD_K)) ** _HEAD_POW * (1.0 + k / _RANK_K0) ** -_RANK_POW
    return out


def _sigmoid(x: F64) -> F64:
    out: F64 = 0.5 * (1.0 + np.tanh(0.5 * x))
    return out


def _entropy(p: F64) -> float:
    q = np.clip(p, 1e-15, 1.0 - 1e-15)
    return float(-np.mean(q * np.log(q) + (1.0 - q) * np.log1p(-q)))


class FieldModel:
    """The draws and the hidden model of a stream declared field by field.

    Built once per stream (deterministic in `seed`); holds per-field
    parameters and head tables only (O(fields × `HEAD`) memory)."""

    def __init__(
        self,
        seed: int,
        categorical: tuple[CategoricalField, ...],
        numeric: tuple[NumericField, ...],
        pairs: tuple[Pair, ...],
        *,
        base_ctr: float,
        bayes_gain: float,
        hour_amplitude: float,
        drift: float,
        fresh: float = 0.0,
    ) -> None:
        self._check(categorical, numeric, pairs, bayes_gain, hour_amplitude)
        self.categorical, self.numeric, self.pairs = categorical, numeric, pairs
        self.drift = drift
        nf = len(categorical)
        index = {c.name: i for i, c in enumerate(categorical)}
        self.card = np.array([c.cardinality for c in categorical], dtype=np.int64)
        self.a = np.array([c.zipf_a for c in categorical], dtype=np.float64)
        self.head_p = np.array([c.head for c in categorical], dtype=np.float64)
        self.cat_missing = np.array([c.missing for c in categorical], dtype=np.float64)
        self.is_hour = np.array([c.hour for c in categorical], dtype=bool)
        self.parent = np.array([index[c.parent] if c.parent else -1 for c in categorical], dtype=np.int64)
        self.parent_share = np.array([c.parent_share for c in categorical], dtype=np.float64)
        self.hour_amplitude = hour_amplitude
        # Ranks drawn from the Zipf law: a dominant rank 0 (`head`) shifts the rest by one.
        self._shift = (self.head_p > 0).astype(np.int64)
        self._n_zipf = self.card - self._shift
        self._h = np.minimum(self._n_zipf, HEAD)
        # Head tables: field f's cumulative head mass lives at f + cdf, so one
        # searchsorted over the concatenation serves every field at once.
        cdfs, head_mass = [], np.zeros(nf)
        self._tail_lo = np.zeros(nf)
        self._tail_mass = np.zeros(nf)
        for f in range(nf):
            h = int(self._h[f])
            s = (np.arange(1, h + 1, dtype=np.float64)) ** -self.a[f]
            lo, hi = h + 0.5, float(self._n_zipf[f]) + 0.5
            tail = self._g(hi, self.a[f]) - self._g(lo, self.a[f]) if self._n_zipf[f] > h else 0.0
            z = float(s.sum()) + tail
            cdfs.append(f + np.cumsum(s) / z)
            head_mass[f] = float(s.sum()) / z
            self._tail_lo[f] = self._g(lo, self.a[f])
            self._tail_mass[f] = tail
        self._cdf_all = np.concatenate(cdfs)
        self._cdf_start = np.concatenate([[0], np.cumsum(self._h)[:-1]]).astype(np.int64)
        self._head_mass = head_mass
        self.offsets = np.concatenate([[0], np.cumsum(self.card)[:-1]]).astype(np.int64)
        """Each field's first code: (offset + rank) numbers every value of every field once."""

        rng = np.random.default_rng([seed, 0x5EED, 1])
        self._key0, self._key1, self._pair_key, self._derive_key = (int(k) for k in rng.integers(0, 2**63, 4))
        self._field_scale = np.array([c.weight for c in categorical], dtype=np.float64)
        self._pair_idx = [(index[p.a], index[p.b], p.strength) for p in pairs]
        self._num_mu = np.array([x.mu for x in numeric], dtype=np.float64)
        self._num_sigma = np.array([x.sigma for x in numeric], dtype=np.float64)
        self._num_missing = np.array([x.missing for x in numeric], dtype=np.float64)
        self._num_negative = np.array([x.negative for x in numeric], dtype=np.float64)
        self._num_w = _NUM_STD * np.array([x.weight for x in numeric]) * rng.choice([-1.0, 1.0], len(numeric))
        self._num_center = np.zeros(len(numeric))
        self._num_spread = np.ones(len(numeric))
        self._cat_center = np.zeros(nf)
        self._cat_center1 = np.zeros(nf)  # of the drift's second weight set
        self._cat_norm = 1.0
        self._pair_norm = np.ones(len(pairs))
        self.scale = 1.0
        self.bias = 0.0
        self._calibrate(np.random.default_rng([seed, 0xCA1, 1]), base_ctr, bayes_gain, fresh)

    @staticmethod
    def _check(
        categorical: tuple[CategoricalField, ...],
        numeric: tuple[NumericField, ...],
        pairs: tuple[Pair, ...],
        bayes_gain: float,
        hour_amplitude: float,
    ) -> None:
        names = [c.name for c in categorical] + [x.name for x in numeric]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError("field names must be non-empty and distinct")
        if sum(c.cardinality for c in categorical) >= 2**32:
            raise ValueError("the categorical cardinalities must sum to < 2**32")
        known = {c.name: c for c in categorical}
        for c in categorical:
            if c.cardinality < 1 or c.zipf_a <= 0 or c.weight < 0:
                raise ValueError(f"field {c.name}: need cardinality >= 1, zipf_a > 0 and weight >= 0")
            if not (0 <= c.missing < 1 and 0 <= c.head < 1 and 0 <= c.parent_share <= 1):
                raise ValueError(f"field {c.name}: missing and head must be in [0, 1), parent_share in [0, 1]")
            if c.head > 0 and (c.cardinality < 2 or c.parent is not None or c.hour):
                raise ValueError(f"field {c.name}: a dominant value needs cardinality >= 2 and a field of its own")
            if c.hour and c.cardinality != 24:
                raise ValueError(f"field {c.name}: an hour field has cardinality 24")
            if c.parent is not None:
                p = known.get(c.parent)
                if p is None or p.parent is not None or p.hour or p is c:
                    raise ValueError(f"field {c.name}: parent {c.parent!r} must be another field drawn on its own")
        for x in numeric:
            if x.sigma < 0 or not (0 <= x.missing < 1 and 0 <= x.negative < 1):
                raise ValueError(f"field {x.name}: need sigma >= 0, missing and negative in [0, 1)")
        for pr in pairs:
            if pr.a not in known or pr.b not in known or pr.a == pr.b:
                raise ValueError(f"pair ({pr.a}, {pr.b}) must name two distinct categorical fields")
        if not 0 < bayes_gain < 1:
            raise ValueError("bayes_gain must be in (0, 1)")
        if hour_amplitude < 0:
            raise ValueError("hour_amplitude must be >= 0")

    # -- draws -------------------------------------------------------------------------

    @staticmethod
    def _g(t: float, a: float) -> float:
        """An antiderivative of t ** -a."""
        return math.log(t) if abs(a - 1.0) < 1e-9 else t ** (1.0 - a) / (1.0 - a)

    def _zipf(self, u: F64, cols: I64) -> I64:
        """Zipf ranks (0-based, before the dominant value's shift) of uniforms
        `u` (n, k) for fields `cols` (k,)."""
        hm = self._head_mass[cols]
        in_head = u < hm
        pos = np.searchsorted(self._cdf_all, u + cols, side="right") - self._cdf_start[cols]
        head_rank = np.minimum(pos, self._h[cols] - 1)
        # The tail: invert the continuous power law's mass between HEAD + 0.5 and N + 0.5.
        a = self.a[cols]
        v = self._tail_lo[cols] + (u - hm) / np.where(hm < 1, 1 - hm, 1.0) * self._tail_mass[cols]
        one = np.abs(a - 1.0) < 1e-9
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            t = np.where(one, np.exp(v), np.maximum(v * (1.0 - a), 1e-300) ** (1.0 / np.where(one, 2.0, 1.0 - a)))
        tail_rank = np.clip(
            np.floor(np.nan_to_num(t, nan=0.0, posinf=0.0) + 0.5) - 1, self._h[cols], self._n_zipf[cols] - 1
        )
        out: I64 = np.where(in_head, head_rank, tail_rank.astype(np.int64))
        return out

    def draw(self, rng: np.random.Generator, n: int, ts: F64) -> tuple[I64, npt.NDArray[np.bool_], F64]:
        """Ranks (n, fields), their missing mask and the counts (n, numeric; NaN missing).

        `ts` is each event's time in seconds (for the hour of day)."""
        nf = len(self.categorical)
        cols = np.arange(nf, dtype=np.int64)
        u = rng.random((n, nf))
        hp = self.head_p
        dominant = u < hp
        rest = (u - hp) / (1.0 - hp)
        ranks = np.where(dominant, 0, self._zipf(np.clip(rest, 0.0, 1.0 - 1e-16), cols) + self._shift)
        derived = np.flatnonzero(self.parent >= 0)
        if derived.size:
            # A derived value is the parent value's own draw from the field's law:
            # a function of the parent's rank (its hash as the uniform).
            par = self.parent[derived]
            hu = _unit(_hash(self._derive_key, derived[None, :], ranks[:, par]))
            from_parent = self._zipf(hu, derived)
            keep = rng.random((n, derived.size)) < self.parent_share[derived]
            ranks[:, derived] = np.where(keep, from_parent, ranks[:, derived])
        if self.is_hour.any():
            hour = np.floor(np.mod(ts, 86400.0) / 3600.0).astype(np.int64)
            ranks[:, self.is_hour] = hour[:, None]
        missing = rng.random((n, nf)) < self.cat_missing
        nn = len(self.numeric)
        z = rng.standard_normal((n, nn))
        nums = np.floor(np.exp(self._num_mu + self._num_sigma * z))
        neg = rng.random((n, nn)) < self._num_negative
        nums = np.where(neg, -np.floor(1.0 + 3.0 * rng.random((n, nn))), nums)
        nums[rng.random((n, nn)) < self._num_missing] = np.nan
        return ranks, missing, nums

    # -- the hidden model --------------------------------------------------------------

    def _weights(self, key: int, ranks: I64, cols: I64) -> F64:
        out: F64 = self._field_scale[cols] * _rank_std(ranks) * hashed_normal(key, cols[None, :], ranks)
        return out

    def _parts(
        self, ranks: I64, missing: npt.NDArray[np.bool_], fresh: npt.NDArray[np.bool_], nums: F64, theta: F64
    ) -> F64:
        """The logit before the signal scale and the bias."""
        cols = np.arange(len(self.categorical), dtype=np.int64)
        off = missing | fresh  # an absent value and a brand-new id carry no weight
        w = np.where(off, 0.0, self._weights(self._key0, ranks, cols) - self._cat_center)
        cat = w.sum(axis=1)
        if self.drift > 0:
            w1 = np.where(off, 0.0, self._weights(self._key1, ranks, cols) - self._cat_center1)
            cat = np.cos(theta) * cat + np.sin(theta) * w1.sum(axis=1)
        logit = cat * self._cat_norm
        for i, (a, b, g) in enumerate(self._pair_idx):
            dims = np.arange(_PAIR_DIM, dtype=np.int64)
            ua = self._factor(ranks[:, a], a, dims)
            ub = self._factor(ranks[:, b], b, dims)
            both = ~(off[:, a] | off[:, b])
            logit = logit + np.where(both, g * self._pair_norm[i] * np.sum(ua * ub, axis=1), 0.0)
        if self.numeric:
            x = np.log1p(np.maximum(nums, 0.0))
            logit = logit + np.nan_to_num((x - self._num_center) / self._num_spread, nan=0.0) @ self._num_w
        if self.hour_amplitude > 0 and self.is_hour.any():
            h = ranks[:, int(np.flatnonzero(self.is_hour)[0])]
            logit = logit + self.hour_amplitude * np.cos(2.0 * math.pi * (h - _HOUR_PEAK) / 24.0)
        out: F64 = logit
        return out

    def _factor(self, ranks: I64, field: int, dims: I64) -> F64:
        std = _rank_std(ranks)
        key = self._pair_key + field
        out: F64 = std[:, None] * hashed_normal(key, dims[None, :], ranks[:, None]) / math.sqrt(_PAIR_DIM)
        return out

    def logit(
        self, ranks: I64, missing: npt.NDArray[np.bool_], fresh: npt.NDArray[np.bool_], nums: F64, offset: F64
    ) -> F64:
        """The hidden model's logit; `offset` is event time since the start (drift)."""
        theta = self.drift * offset / 3600.0
        out: F64 = self.bias + self.scale * self._parts(ranks, missing, fresh, nums, theta)
        return out

    def _calibrate(self, rng: np.random.Generator, base_ctr: float, bayes_gain: float, fresh: float) -> None:
        """Centre and normalise the parts, then solve the signal scale for
        `bayes_gain` and the bias for mean p_true = `base_ctr` (on events
        with the stream's share of brand-new ids, which carry no weight)."""
        n = _CALIBRATION_EVENTS
        day = rng.uniform(0.0, 86400.0, n)  # every hour of the day alike
        ranks, missing, nums = self.draw(rng, n, day)
        new = (rng.random(ranks.shape) < fresh) & ~missing & ~self.is_hour
        cols = np.arange(len(self.categorical), dtype=np.int64)
        present = ~missing

        def centre(w: F64) -> F64:
            return np.array([float(w[present[:, f], f].mean()) if present[:, f].any() else 0.0 for f in cols])

        w = self._weights(self._key0, ranks, cols)
        self._cat_center = centre(w)
        if self.drift > 0:
            self._cat_center1 = centre(self._weights(self._key1, ranks, cols))
        if self.numeric:
            x = np.log1p(np.maximum(nums, 0.0))
            self._num_center = np.nan_to_num(np.nanmean(x, axis=0), nan=0.0)
            spread = np.nan_to_num(np.nanstd(x, axis=0), nan=0.0)
            self._num_spread = np.where(spread > 0, spread, 1.0)
        cat = np.where(missing, 0.0, w - self._cat_center).sum(axis=1)
        self._cat_norm = 1.0 / max(float(np.std(cat)), 1e-12)
        for i, (a, b, _) in enumerate(self._pair_idx):
            dims = np.arange(_PAIR_DIM, dtype=np.int64)
            prod = np.sum(self._factor(ranks[:, a], a, dims) * self._factor(ranks[:, b], b, dims), axis=1)
            self._pair_norm[i] = 1.0 / max(float(np.std(prod)), 1e-12)
        parts = self._parts(ranks, missing, new, nums, np.zeros(n))
        target = math.log(base_ctr / (1.0 - base_ctr))
        h0 = _entropy(np.array([base_ctr]))

        def solve_bias(s: float) -> tuple[float, F64]:
            b = target - s * float(parts.mean())
            for _ in range(60):  # Newton on mean(sigmoid(s·parts + b)) = base_ctr
                p = _sigmoid(s * parts + b)
                err = float(p.mean()) - base_ctr
                if abs(err) < 1e-10:
                    break
                b -= err / max(float(np.mean(p * (1.0 - p))), 1e-9)
            return b, p

        lo, hi = 0.0, 1.0
        while 1.0 - _entropy(solve_bias(hi)[1]) / h0 < bayes_gain and hi < 1e3:
            lo, hi = hi, hi * 2.0
        for _ in range(40):  # the gain grows with the scale: bisect it
            mid = 0.5 * (lo + hi)
            if 1.0 - _entropy(solve_bias(mid)[1]) / h0 < bayes_gain:
                lo = mid
            else:
                hi = mid
        self.scale = 0.5 * (lo + hi)
        self.bias = solve_bias(self.scale)[0]
