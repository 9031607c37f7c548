"""A synthetic, Criteo-like click stream with a hidden ground-truth model.

`SyntheticStream` emits events in the event format (docs/architecture.md, "Events and feature ids")::

    {"id": "s-0-000123", "ts": 1764681600.25, "label": 0,
     "features": {"I1": 3.0, ..., "C1": "68fd1e64", ...}, "p_true": 0.031}

- ``I1..I<num_numeric>``: nonnegative integer counts (lognormal, floored) sent as
  floats; each field has its own missing rate and a missing value is omitted.
- ``C1..C<num_categorical>``: Zipf-distributed value ranks per field, rendered as
  8-hex-character strings. The rendering is a bijection of (field, rank) mixed
  with the seed, so strings are stable per (seed, field, rank) and never collide.
- ``fresh`` > 0: each categorical value is, with that probability, a brand-new
  id seen once and never again (12 hex characters, unique per event and
  field), the long tail of a real stream (new sessions, creatives, queries).
  Such values carry no weight in the hidden model.
- ``ts`` advances by exponential gaps with mean ``1 / events_per_s`` (event time,
  strictly increasing); ``id`` is ``s-<seed>-<index>`` (zero-padded to 6 digits).
- ``p_true`` is the click probability under the hidden model and ``label`` is a
  Bernoulli draw from it, so the best achievable logloss is `bayes_logloss`.

The hidden model is logistic::

    logit = bias + Σ_f w[f, rank_f] + Σ_pairs v[pair][rank_a, rank_b]
                 + Σ_j u_j·(log1p(I_j) − c_j)

- Per-(field, value) weights are normal, with a per-field scale (a few fields
  matter much more than others, as in real data) and a scale that shrinks with
  the value's Zipf rank. The shrinkage keeps most of the signal on values that a
  learner sees often, so a linear model with hashed one-hot features trained on
  ~50k events gets within a few hundredths of the ground truth's AUC; it is also
  what real CTR data looks like after regularisation: rare values carry little.
- A few weak pairwise interactions between categorical fields (on their most
  frequent values) make LR imperfect and give FM something to find.
- A weak effect of ``log1p`` of each numeric feature (``numeric_truth
  "linear"``: of the count itself, scaled to the same spread; a check that
  a learner's numeric handling is not chosen for this generator alone).
- ``bias`` is solved at construction so that the mean of ``p_true`` is ``base_ctr``.
- ``drift > 0`` rotates the categorical weights towards a second, independent
  set: ``w(t) = cos θ · w0 + sin θ · w1`` with ``θ = drift · (ts − start_ts) / 3600``
  (radians per hour of event time). The rotation keeps the weights' variance, so
  the base rate and the attainable AUC stay put while what is learnt goes stale.

Determinism: events are generated in fixed blocks of `BLOCK` events, each from its
own random generator seeded by (seed, block number), so event *i* of a seed is the
same whatever batch sizes were asked for; different seeds give different models
and different streams.

Declared fields: given ``categorical_fields`` (and ``numeric_fields``, ``pairs``,
``bayes_gain``, ``hour_amplitude``), the stream's fields and hidden model are those
of `ps_core.synthetic.fields` instead (per-field cardinalities, Zipf exponents,
missing values, derived fields, hour of day, heavy-tailed counts; the profiles of
`ps_core.synthetic.profiles` are such streams). Everything above holds for them
but the field names and the model; the default stream is unchanged by them.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any

import numpy as np
import numpy.typing as npt

from .fields import CategoricalField, FieldModel, NumericField, Pair

__all__ = ["SyntheticStream", "bayes_logloss", "BLOCK"]

BLOCK = 8192
"""Events generated per internal block (the unit of determinism)."""

F64 = npt.NDArray[np.float64]
_HOURS: npt.NDArray[np.object_] = np.array([f"{h:02d}" for h in range(24)], dtype=object)
_RENDERED = 4096  # a declared field's ranks rendered once at construction

# Shape constants of the hidden model, tuned (see tests/test_producers.py) so that the
# ground truth reaches AUC ≈ 0.86-0.89 for any seed, and LR on one-hot features trained
# on 40-50k events gets within ~0.01-0.015 of it with FTRL-proximal (L1 ignores the tail)
# and ~0.03 with unregularised Adagrad.
_CAT_STD = 1.8  # std of the categorical part of the logit (sum over fields)
_FIELD_DISPERSION = 0.6  # field scales are exp(N(0, this)): a few fields matter most
_RANK_K0 = 2.0  # weight std of rank k is scaled by (1 + k / _RANK_K0) ** -_RANK_POW
_RANK_POW = 1.5
_NUM_PAIRS = 3  # weak pairwise interactions between categorical fields
_PAIR_HEAD = 8  # ... on each field's 8 most frequent values (others share one slot)
_PAIR_STD = 0.12
_NUM_STD = 0.05  # weight std per log1p(numeric)
_CALIBRATION_EVENTS = 32_768  # events used to solve the bias for base_ctr


@dataclass(frozen=True)
class _Block:
    """Column arrays for consecutive events."""

    ranks: npt.NDArray[np.int32]  # (n, num_categorical)
    nums: F64  # (n, num_numeric), NaN = missing
    ts: F64
    p: F64
    label: npt.NDArray[np.int8]
    fresh: npt.NDArray[np.bool_]  # (n, num_categorical): a brand-new id instead of the rank's
    missing: npt.NDArray[np.bool_]  # (n, num_categorical): the field is absent

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    def split(self, n: int) -> tuple[_Block, _Block]:
        return (
            _Block(*(a[:n] for a in self._columns())),
            _Block(*(a[n:] for a in self._columns())),
        )

    def _columns(self) -> tuple[Any, ...]:
        return (self.ranks, self.nums, self.ts, self.p, self.label, self.fresh, self.missing)

    @staticmethod
    def concat(blocks: Sequence[_Block]) -> _Block:
        if len(blocks) == 1:
            return blocks[0]
        return _Block(*(np.concatenate(cols) for cols in zip(*(b._columns() for b in blocks), strict=True)))


def _sigmoid(x: F64) -> F64:
    out: F64 = 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic
    return out


def _mix32(x: npt.NDArray[np.uint32], key: int) -> npt.NDArray[np.uint32]:
    """A bijection of uint32 (xor, odd multiplies, xorshifts): distinct in, distinct out."""
    x = x ^ np.uint32(key)
    x = x * np.uint32(0x9E3779B1)
    x ^= x >> np.uint32(16)
    x = x * np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x = x * np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


@dataclass(eq=False)
class SyntheticStream:
    """A deterministic (per seed) Criteo-like click stream; see the module docstring.

    ``batch(n)`` returns the next `n` events as dicts; ``iter_batches(total, size)``
    yields lists until `total` events were produced. ``produced`` counts events
    returned so far.
    """

    seed: int = 0
    num_numeric: int = 13
    num_categorical: int = 26
    vocab: int = 10_000
    zipf_a: float = 1.2
    start_ts: float = 1_764_681_600.0
    events_per_s: float = 1000.0
    drift: float = 0.0
    base_ctr: float = 0.1
    fresh: float = 0.0
    numeric_truth: str = "log1p"
    """How the counts act in the hidden model: through ``log1p`` of each, or
    (``linear``) through the counts themselves, scaled to the same spread."""
    categorical_fields: tuple[CategoricalField, ...] = ()
    """Fields declared one by one (`ps_core.synthetic.fields`); when given, they
    and `numeric_fields`, `pairs`, `bayes_gain` and `hour_amplitude` make the
    stream, and `num_numeric`, `num_categorical`, `vocab`, `zipf_a` and
    `numeric_truth` are not used (the two counts become the fields' numbers)."""
    numeric_fields: tuple[NumericField, ...] = ()
    pairs: tuple[Pair, ...] = ()
    bayes_gain: float = 0.2
    """Of declared fields: the share of the constant model's log loss that the
    truth removes (1 − Bayes log loss / constant log loss); solved at construction."""
    hour_amplitude: float = 0.0
    """Of declared fields with an hour field: the daily cycle's logit amplitude."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError("seed must be >= 0")
        self._fm: FieldModel | None = None
        if self.categorical_fields:
            self._init_fields()
            return
        if self.numeric_fields or self.pairs:
            raise ValueError("numeric_fields and pairs need categorical_fields")
        seed, num_numeric, num_categorical, vocab = self.seed, self.num_numeric, self.num_categorical, self.vocab
        if num_numeric < 0 or num_categorical < 1:
            raise ValueError("need num_numeric >= 0 and num_categorical >= 1")
        if vocab < 1 or num_categorical * vocab >= 2**32:
            raise ValueError("vocab must be >= 1 and num_categorical * vocab < 2**32")
        if self.zipf_a <= 0:
            raise ValueError("zipf_a must be > 0")
        if self.numeric_truth not in ("log1p", "linear"):
            raise ValueError("numeric_truth must be log1p or linear")
        self._check_rates()
        self.num_names = [f"I{j + 1}" for j in range(num_numeric)]
        self.cat_names = [f"C{f + 1}" for f in range(num_categorical)]

        rng = np.random.default_rng([seed, 0x5EED])  # the model's own stream
        ranks = np.arange(vocab, dtype=np.float64)
        pmf = (ranks + 1.0) ** -self.zipf_a
        self._pmf: F64 = pmf / pmf.sum()
        self._cdf: F64 = np.cumsum(self._pmf)
        self._cdf[-1] = 1.0

        # Categorical weights: field scale × rank shrinkage × N(0, 1), a few fields
        # mattering more than others (lognormal scales). Each field's weights are centred
        # under its Zipf distribution and the whole set is rescaled so that the logit's
        # categorical part has std _CAT_STD exactly: the attainable AUC then depends on
        # the shape constants, not on the luck of a seed's draws.
        field_scale = np.exp(rng.normal(0.0, _FIELD_DISPERSION, num_categorical))
        std = field_scale[:, None] * ((1.0 + ranks / _RANK_K0) ** -_RANK_POW)[None, :]
        self._w0 = self._normalised(std * rng.standard_normal((num_categorical, vocab)))
        self._w1 = self._normalised(std * rng.standard_normal((num_categorical, vocab)))

        n_pairs = min(_NUM_PAIRS, num_categorical // 2)
        fields = rng.permutation(num_categorical)[: 2 * n_pairs]
        self._pairs = [(int(fields[2 * i]), int(fields[2 * i + 1])) for i in range(n_pairs)]
        self._pair_w: F64 = _PAIR_STD * rng.standard_normal((n_pairs, _PAIR_HEAD, _PAIR_HEAD))

        # Counts of modest size (medians 1-4, p99 ~15-20, max a few hundred): a worker that
        # feeds raw values to LR then loses only ~0.003 AUC against log1p (Criteo-sized
        # counts in the thousands cost it ~0.015).
        self._num_mu: F64 = rng.uniform(0.0, 1.5, num_numeric)
        self._num_sigma: F64 = rng.uniform(0.5, 1.0, num_numeric)
        self._num_missing: F64 = np.where(rng.random(num_numeric) < 0.6, rng.uniform(0.0, 0.45, num_numeric), 0.0)
        self._num_w: F64 = _NUM_STD * rng.standard_normal(num_numeric)
        self._num_center: F64 = np.zeros(num_numeric)
        self._num_scale: F64 = np.ones(num_numeric)
        self._hex_key = int(rng.integers(0, 2**32))
        self.bias = 0.0
        self._calibrate(np.random.default_rng([seed, 0xCA1]))

        self._fidx = np.arange(num_categorical)
        self._codes = self._fidx.astype(np.uint32) * np.uint32(self.vocab)  # each field's first value code
        self._names = self.num_names + self.cat_names
        # Up to 1M strings (~65 MB) are rendered once; a larger vocabulary renders per batch.
        self._hex_table: npt.NDArray[np.object_] | None = None
        if num_categorical * vocab <= 1 << 20:
            grid = np.arange(vocab, dtype=np.int32)[:, None] + np.zeros(num_categorical, np.int32)
            self._hex_table = self._hex(grid).T.copy()
        self._start()

    def _check_rates(self) -> None:
        if self.events_per_s <= 0 or not math.isfinite(self.events_per_s):
            raise ValueError("events_per_s must be a positive number")
        if self.drift < 0:
            raise ValueError("drift must be >= 0")
        if not 0.0 < self.base_ctr < 1.0:
            raise ValueError("base_ctr must be in (0, 1)")
        if not 0.0 <= self.fresh < 1.0:
            raise ValueError("fresh must be in [0, 1)")
        # Ints given for the rates are kept as floats.
        for name in ("start_ts", "events_per_s", "drift", "base_ctr", "fresh"):
            setattr(self, name, float(getattr(self, name)))

    def _start(self) -> None:
        self._next_block = 0
        self._next_offset = 0.0  # event time since start_ts after the last generated event
        self._pending: list[_Block] = []
        self._pending_len = 0
        self.produced = 0

    def _init_fields(self) -> None:
        """A stream of declared fields: the model is `FieldModel`'s."""
        self._check_rates()
        cats, nums = tuple(self.categorical_fields), tuple(self.numeric_fields)
        self.categorical_fields, self.numeric_fields, self.pairs = cats, nums, tuple(self.pairs)
        self.num_numeric, self.num_categorical = len(nums), len(cats)
        self.num_names = [x.name for x in nums]
        self.cat_names = [c.name for c in cats]
        self._fm = FieldModel(
            self.seed,
            cats,
            nums,
            self.pairs,
            base_ctr=self.base_ctr,
            bayes_gain=float(self.bayes_gain),
            hour_amplitude=float(self.hour_amplitude),
            drift=self.drift,
            fresh=self.fresh,
        )
        self.bias = self._fm.bias
        self._hex_key = int(np.random.default_rng([self.seed, 0x5EED]).integers(0, 2**32))
        self._fidx = np.arange(len(cats))
        self._codes = self._fm.offsets.astype(np.uint32)
        self._names = self.num_names + self.cat_names
        # Each field's most frequent values are rendered once (4096 strings a
        # field at most, ~6 MB for 26 fields); rarer ones per batch.
        head = np.minimum(np.arange(_RENDERED, dtype=np.uint32)[:, None], (self._fm.card - 1).astype(np.uint32))
        table = self._render(head + self._codes).reshape(head.shape).T.copy()
        # The hour of day reads as Avazu's: "00".."23".
        table[self._fm.is_hour, :24] = _HOURS
        self._hex_table = table
        self._start()

    # -- the hidden model --------------------------------------------------------------

    def _normalised(self, w: F64) -> F64:
        w = w - (w @ self._pmf)[:, None]
        var = float(np.sum((w * w) @ self._pmf))
        out: F64 = w * (_CAT_STD / math.sqrt(var))
        return out

    def _draw(self, rng: np.random.Generator, n: int) -> tuple[npt.NDArray[np.int32], F64]:
        u = rng.random((n, self.num_categorical))
        ranks = np.minimum(np.searchsorted(self._cdf, u, side="right"), self.vocab - 1)
        z = rng.standard_normal((n, self.num_numeric))
        nums = np.floor(np.exp(self._num_mu + self._num_sigma * z))
        nums[rng.random((n, self.num_numeric)) < self._num_missing] = np.nan
        return ranks.astype(np.int32), nums

    def _logit(self, ranks: npt.NDArray[np.int32], nums: F64, offset: F64) -> F64:
        fidx = np.arange(self.num_categorical)
        cat: F64 = self._w0[fidx, ranks].sum(axis=1)
        if self.drift > 0.0:
            theta = self.drift * offset / 3600.0
            cat = np.cos(theta) * cat + np.sin(theta) * self._w1[fidx, ranks].sum(axis=1)
        logit = self.bias + cat
        for i, (a, b) in enumerate(self._pairs):
            ha = np.minimum(ranks[:, a], _PAIR_HEAD - 1)
            hb = np.minimum(ranks[:, b], _PAIR_HEAD - 1)
            logit += self._pair_w[i, ha, hb]
        if self.num_numeric:
            contrib = np.nan_to_num((self._num_effect(nums) - self._num_center) * self._num_scale, nan=0.0)
            logit += contrib @ self._num_w
        return logit

    def _num_effect(self, nums: F64) -> F64:
        """What the counts act through (NaN where missing): `numeric_truth`."""
        return np.log1p(nums) if self.numeric_truth == "log1p" else nums

    def _calibrate(self, rng: np.random.Generator) -> None:
        """Centre the numeric effects and solve the bias for mean p_true = base_ctr."""
        ranks, nums = self._draw(rng, _CALIBRATION_EVENTS)
        if self.num_numeric:
            effect = self._num_effect(nums)
            self._num_center = np.nan_to_num(np.nanmean(effect, axis=0), nan=0.0)
            if self.numeric_truth == "linear":
                # The spread log1p would give, so only the shape differs.
                spread = np.nanstd(effect, axis=0)
                self._num_scale = np.nan_to_num(np.nanstd(np.log1p(nums), axis=0) / np.where(spread > 0, spread, 1.0))
        logit0 = self._logit(ranks, nums, np.zeros(len(ranks)))
        target = math.log(self.base_ctr / (1.0 - self.base_ctr))
        b = target - float(np.mean(logit0)) + self.bias
        for _ in range(50):  # Newton on mean(sigmoid(l + b)) = base_ctr; converges in ~5
            p = _sigmoid(logit0 - self.bias + b)
            err = float(p.mean()) - self.base_ctr
            if abs(err) < 1e-9:
                break
            b -= err / max(float(np.mean(p * (1.0 - p))), 1e-6)
        self.bias = b

    # -- generation --------------------------------------------------------------------

    def _gen_block(self) -> _Block:
        rng = np.random.default_rng([self.seed, 1, self._next_block])
        self._next_block += 1
        if self._fm is not None:
            return self._gen_fields_block(rng)
        ranks, nums = self._draw(rng, BLOCK)
        offset = self._offsets(rng)
        fresh = np.zeros(ranks.shape, dtype=bool)
        if self.fresh > 0:
            # Drawn from the block's own generator after everything else, so
            # a stream without fresh ids is what it always was.
            fresh = np.random.default_rng([self.seed, 2, self._next_block - 1]).random(ranks.shape) < self.fresh
            ranks = np.where(fresh, self.vocab - 1, ranks).astype(np.int32)  # the rarest weight: ~0
        p = _sigmoid(self._logit(ranks, nums, offset))
        label = (rng.random(BLOCK) < p).astype(np.int8)
        return _Block(ranks, nums, self.start_ts + offset, p, label, fresh, np.zeros(ranks.shape, dtype=bool))

    def _offsets(self, rng: np.random.Generator) -> F64:
        # A floor on the gap keeps ts strictly increasing after float rounding at ~1.7e9.
        gaps = np.maximum(rng.exponential(1.0 / self.events_per_s, BLOCK), 1e-6)
        offset: F64 = self._next_offset + np.cumsum(gaps)
        self._next_offset = float(offset[-1])
        return offset

    def _gen_fields_block(self, rng: np.random.Generator) -> _Block:
        fm = self._fm
        assert fm is not None
        offset = self._offsets(rng)  # first: the hour of day is a field
        ts = self.start_ts + offset
        ranks, missing, nums = fm.draw(rng, BLOCK, ts)
        fresh = np.zeros(ranks.shape, dtype=bool)
        if self.fresh > 0:
            fresh = np.random.default_rng([self.seed, 2, self._next_block - 1]).random(ranks.shape) < self.fresh
            fresh &= ~missing & ~fm.is_hour
        p = _sigmoid(fm.logit(ranks, missing, fresh, nums, offset))
        label = (rng.random(BLOCK) < p).astype(np.int8)
        return _Block(ranks.astype(np.int32), nums, ts, p, label, fresh, missing)

    def _take(self, n: int) -> _Block:
        while self._pending_len < n:
            blk = self._gen_block()
            self._pending.append(blk)
            self._pending_len += len(blk)
        out, rest = _Block.concat(self._pending).split(n)
        self._pending = [rest] if len(rest) else []
        self._pending_len = len(rest)
        return out

    def _hex(self, ranks: npt.NDArray[np.int32]) -> npt.NDArray[np.object_]:
        """8-hex-char strings (as an object array) for a (n, fields) rank matrix."""
        if self._hex_table is not None and self._fm is None:
            table: npt.NDArray[np.object_] = self._hex_table[self._fidx, ranks]
            return table
        if self._hex_table is not None:
            # Declared fields: the table holds each field's first ranks; the rest are rendered.
            top = self._hex_table.shape[1]
            table = self._hex_table[self._fidx, np.minimum(ranks, top - 1)]
            tail = ranks >= top
            if tail.any():
                rows, cols = np.nonzero(tail)
                table[rows, cols] = self._render(ranks[rows, cols].astype(np.uint32) + self._codes[cols])
            return table
        return self._render(ranks.astype(np.uint32) + self._codes).reshape(ranks.shape)

    def _render(self, codes: npt.NDArray[np.uint32]) -> npt.NDArray[np.object_]:
        """The 8-hex-char string of each value code (field's first code + rank)."""
        text = _mix32(codes, self._hex_key).astype(">u4").tobytes().hex().encode("ascii")
        strs: npt.NDArray[np.object_] = np.frombuffer(text, dtype="S8").astype("U8").astype(object)
        return strs

    def _fresh_ids(self, cells: npt.NDArray[np.int64]) -> npt.NDArray[np.object_]:
        """12-hex-char ids of (event, field) cells: an odd multiply mod 2**48 is
        a bijection, so distinct cells give distinct ids (and 12 characters
        never equal a vocabulary value's 8)."""
        mixed = (cells.astype(np.uint64) * np.uint64(0x9E3779B97F4B) + np.uint64(self._hex_key)) & np.uint64(
            (1 << 48) - 1
        )
        text = mixed.astype(">u8").tobytes().hex().encode("ascii")
        # Each id is the last 12 of its 16 hex characters (the top 16 bits are 0).
        chars = np.frombuffer(text, dtype=np.uint8).reshape(-1, 16)[:, 4:].copy()
        out: npt.NDArray[np.object_] = chars.view("S12").reshape(-1).astype("U12").astype(object)
        return out

    def batch(self, n: int) -> list[dict[str, Any]]:
        """The next `n` events (ids unique, ts strictly increasing)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return []
        blk = self._take(n)
        first = self.produced
        self.produced += n
        # Everything is converted column-wise in numpy; the loop below only assembles
        # dicts. A missing numeric is NaN, dropped by `compress` with the presence mask
        # (categoricals are always present), so no per-field Python test runs.
        cats = self._hex(blk.ranks)
        if blk.fresh.any():
            rows, cols = np.nonzero(blk.fresh)
            cats[rows, cols] = self._fresh_ids((first + rows) * self.num_categorical + cols)
        values = np.concatenate([blk.nums.astype(object), cats], axis=1)
        present = np.ones(values.shape, dtype=bool)
        present[:, : self.num_numeric] = ~np.isnan(blk.nums)
        present[:, self.num_numeric :] = ~blk.missing
        names = self._names
        prefix = f"s-{self.seed}-"
        # The dicts hold no cycles; the collector's passes over them while they are
        # built would take ~40% of the time, so it is paused for the loop.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return [
                {
                    "id": f"{prefix}{i:06d}",
                    "ts": ts,
                    "label": label,
                    "features": dict(compress(zip(names, row), mask)),
                    "p_true": p,
                }
                for i, ts, label, row, mask, p in zip(
                    range(first, first + n),
                    blk.ts.tolist(),
                    blk.label.tolist(),
                    values.tolist(),
                    present.tolist(),
                    blk.p.tolist(),
                )
            ]
        finally:
            if gc_was_enabled:
                gc.enable()

    def iter_batches(self, total: int, batch: int = 10_000) -> Iterator[list[dict[str, Any]]]:
        """Yield lists of at most `batch` events until `total` events were yielded."""
        if total < 0 or batch < 1:
            raise ValueError("need total >= 0 and batch >= 1")
        left = total
        while left > 0:
            n = min(batch, left)
            left -= n
            yield self.batch(n)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """An endless iterator of events (generated 10,000 at a time)."""
        while True:
            yield from self.batch(10_000)


def bayes_logloss(p_true: Sequence[float] | F64, labels: Sequence[int] | npt.NDArray[Any]) -> float:
    """Mean logloss of the true probabilities: the best any model can expect."""
    p = np.clip(np.asarray(p_true, dtype=np.float64), 1e-12, 1.0 - 1e-12)
    y = np.asarray(labels, dtype=np.float64)
    if p.shape != y.shape or p.size == 0:
        raise ValueError("p_true and labels must be non-empty and of equal length")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
