"""Named stream profiles shaped like public CTR logs (`PROFILES`, `profile_stream`).

Each profile declares its fields from published descriptions of a dataset
(cardinalities, missing rates, value ranges, base click rate); no real row
is used. docs/synthetic.md lists the figures each follows and the figures
each stream has, measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .fields import CategoricalField, NumericField, Pair
from .stream import SyntheticStream

__all__ = ["PROFILES", "Profile", "profile_stream"]

_Z_MAX = 5.6  # the normal quantile of the largest of ~45M draws: a field's maximum


@dataclass(frozen=True)
class Profile:
    """A named stream shape: the `SyntheticStream` parameters it sets, and its sources."""

    name: str
    summary: str
    """One line (for ``ctrps produce synthetic --help``)."""
    sources: str
    """The public figures the shape follows (dataset, paper)."""
    categorical: tuple[CategoricalField, ...]
    numeric: tuple[NumericField, ...] = ()
    pairs: tuple[Pair, ...] = ()
    base_ctr: float = 0.1
    bayes_gain: float = 0.2
    hour_amplitude: float = 0.0
    drift: float = 0.0
    fresh: float = 0.0
    events_per_s: float = 1000.0

    def params(self) -> dict[str, Any]:
        """`SyntheticStream` keyword arguments of this profile."""
        return {
            "categorical_fields": self.categorical,
            "numeric_fields": self.numeric,
            "pairs": self.pairs,
            "base_ctr": self.base_ctr,
            "bayes_gain": self.bayes_gain,
            "hour_amplitude": self.hour_amplitude,
            "drift": self.drift,
            "fresh": self.fresh,
            "events_per_s": self.events_per_s,
        }


def _count(name: str, median: float, maximum: float, missing: float, negative: float = 0.0) -> NumericField:
    """A lognormal count with about this median and this maximum over ~45M events."""
    mu = math.log(median + 0.5) if median >= 1 else -0.7
    sigma = (math.log(maximum) - mu) / _Z_MAX
    return NumericField(name, mu=mu, sigma=sigma, missing=missing, negative=negative)


# -- criteo ------------------------------------------------------------------------------
# Kaggle Display Advertising Challenge (Criteo, 2014), training set (45,840,617 rows
# over 7 days). Cardinalities: the per-field counts of DLRM's Kaggle preprocessing
# (Naumov et al., "Deep Learning Recommendation Model for Personalization and
# Recommendation Systems", 2019). Count medians, maxima and missing rates: the
# training set's published summary statistics (approximate).
_CRITEO_CARD = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
_CRITEO_CAT_MISSING = {3: 0.034, 4: 0.034, 12: 0.034, 16: 0.034, 19: 0.44, 20: 0.44, 21: 0.034, 22: 0.763,
                       24: 0.034, 25: 0.44, 26: 0.44}  # fmt: skip
# A few fields carry most of the signal, as in real data (relative weight stds).
_CRITEO_WEIGHT = {2: 1.6, 6: 1.4, 9: 1.2, 14: 1.5, 17: 1.3, 20: 1.2, 23: 1.8, 25: 1.4}
_CRITEO_COUNTS = (
    # name, median, maximum, missing
    ("I1", 1, 5775, 0.454), ("I2", 3, 257675, 0.0), ("I3", 7, 65535, 0.215), ("I4", 6, 969, 0.217),
    ("I5", 2925, 23159456, 0.026), ("I6", 33, 431037, 0.224), ("I7", 3, 56311, 0.043), ("I8", 7, 6047, 0.0005),
    ("I9", 38, 29019, 0.043), ("I10", 1, 11, 0.454), ("I11", 1, 231, 0.043), ("I12", 0, 4008, 0.766),
    ("I13", 4, 7393, 0.217),
)  # fmt: skip


def _zipf_for(card: int) -> float:
    # Small vocabularies are dominated by a few values; fields of millions
    # (user, item ids) are flat enough that most of what arrives is new.
    return 1.2 if card < 1_000 else 1.05 if card < 100_000 else 0.85 if card < 1_000_000 else 0.7


def _weight_for(card: int) -> float:
    # Fields of a few values are learnt from a few thousand events; the signal
    # sits mostly in fields of thousands to hundreds of thousands of values,
    # each value seen a few times to a few hundred times in a million events.
    return 0.3 if card < 100 else 0.6 if card < 1_000 else 1.3 if card < 1_000_000 else 1.0


_CRITEO_CATEGORICAL = tuple(
    CategoricalField(
        f"C{i}",
        card,
        zipf_a=_zipf_for(card),
        missing=_CRITEO_CAT_MISSING.get(i, 0.0),
        weight=_weight_for(card) * _CRITEO_WEIGHT.get(i, 1.0),
    )
    for i, card in enumerate(_CRITEO_CARD, start=1)
)
_CRITEO_NUMERIC = tuple(
    _count(name, med, mx, miss, negative=0.005 if name == "I2" else 0.0) for name, med, mx, miss in _CRITEO_COUNTS
)
_CRITEO_PAIRS = (Pair("C2", "C6", 0.35), Pair("C14", "C17", 0.35), Pair("C23", "C25", 0.3))
_CRITEO_SOURCES = (
    "Kaggle Display Advertising Challenge (Criteo, 2014): 45,840,617 rows over 7 days, CTR 25.6%; "
    "C1-C26 cardinalities as counted in DLRM (Naumov et al., 2019) for the Kaggle set; count fields' "
    "medians, maxima and missing rates from the training set's published summary statistics; best "
    "published log loss ~0.44 against the constant model's ~0.57"
)

# -- avazu -------------------------------------------------------------------------------
# Avazu Click-Through Rate Prediction (Kaggle, 2014): 40,428,967 rows over 10 days
# (240 hours), CTR 16.98%. Cardinalities as published for the training set
# (e.g. Song et al., "AutoInt", 2019, and the dataset's public analyses).
_AVAZU_CATEGORICAL = (
    CategoricalField("hour", 24, hour=True, weight=0.6),
    CategoricalField("C1", 7, zipf_a=3.0, weight=0.5),
    CategoricalField("banner_pos", 7, zipf_a=2.5, weight=0.8),
    CategoricalField("site_id", 4737, zipf_a=1.1, weight=1.6),
    CategoricalField("site_domain", 7745, zipf_a=1.1, parent="site_id", parent_share=0.9, weight=0.8),
    CategoricalField("site_category", 26, zipf_a=1.5, parent="site_id", parent_share=0.95, weight=0.8),
    CategoricalField("app_id", 8552, zipf_a=1.1, head=0.64, weight=1.6),
    CategoricalField("app_domain", 559, zipf_a=1.2, parent="app_id", parent_share=0.95, weight=0.6),
    CategoricalField("app_category", 36, zipf_a=1.5, parent="app_id", parent_share=0.95, weight=0.8),
    CategoricalField("device_id", 2686408, zipf_a=0.6, head=0.82, weight=0.8),
    CategoricalField("device_ip", 6729486, zipf_a=0.6, weight=0.8),
    CategoricalField("device_model", 8251, zipf_a=1.05, weight=1.0),
    CategoricalField("device_type", 5, zipf_a=3.0, weight=0.5),
    CategoricalField("device_conn_type", 4, zipf_a=2.5, weight=0.6),
    CategoricalField("C14", 2626, zipf_a=1.0, weight=1.8),
    CategoricalField("C15", 8, zipf_a=3.5, weight=0.5),
    CategoricalField("C16", 9, zipf_a=3.5, weight=0.5),
    CategoricalField("C17", 435, zipf_a=1.1, weight=1.4),
    CategoricalField("C18", 4, zipf_a=1.5, weight=0.8),
    CategoricalField("C19", 68, zipf_a=1.3, weight=0.8),
    CategoricalField("C20", 172, zipf_a=1.0, head=0.47, weight=1.0),
    CategoricalField("C21", 60, zipf_a=1.2, weight=1.2),
)
_AVAZU_PAIRS = (
    Pair("site_id", "device_model", 0.5),
    Pair("app_id", "C14", 0.5),
    Pair("hour", "site_category", 0.4),
    Pair("C17", "banner_pos", 0.4),
)
_AVAZU_SOURCES = (
    "Avazu Click-Through Rate Prediction (Kaggle, 2014): 40,428,967 rows over 240 hours, CTR 16.98%; "
    "training-set cardinalities as published (site_id 4,737, site_domain 7,745, site_category 26, "
    "app_id 8,552, app_domain 559, app_category 36, device_id 2,686,408 with one value on ~82%, "
    "device_ip 6,729,486, device_model 8,251, device_type 5, device_conn_type 4, C1 7, banner_pos 7, "
    "C14 2,626, C15 8, C16 9, C17 435, C18 4, C19 68, C20 172, C21 60); best published log loss "
    "~0.38 against the constant model's ~0.46"
)

# -- sparse_click ------------------------------------------------------------------------
# iPinYou RTB dataset (Liao et al., "iPinYou Global RTB Bidding Algorithm Competition
# Dataset", 2014; Zhang et al., "Real-Time Bidding Benchmarking with iPinYou Dataset",
# 2014): impression logs with CTR ~0.08%; field cardinalities approximate.
_SPARSE_CATEGORICAL = (
    CategoricalField("weekday", 7, zipf_a=0.2, weight=0.4),
    CategoricalField("hour", 24, hour=True, weight=0.6),
    CategoricalField("useragent", 40, zipf_a=1.5, weight=0.8),
    CategoricalField("region", 35, zipf_a=0.9, weight=0.8),
    CategoricalField("city", 370, zipf_a=1.0, parent="region", parent_share=0.97, weight=0.8),
    CategoricalField("adexchange", 4, zipf_a=0.8, weight=0.6),
    CategoricalField("domain", 24_000, zipf_a=1.05, weight=1.4),
    CategoricalField("url", 830_000, zipf_a=0.85, parent="domain", parent_share=0.3, weight=0.6),
    CategoricalField("slotid", 52_000, zipf_a=1.0, weight=1.4),
    CategoricalField("slotwidth", 21, zipf_a=1.8, parent="slotid", parent_share=0.98, weight=0.6),
    CategoricalField("slotheight", 14, zipf_a=1.8, parent="slotid", parent_share=0.98, weight=0.6),
    CategoricalField("slotvisibility", 11, zipf_a=1.5, weight=0.8),
    CategoricalField("slotformat", 4, zipf_a=1.5, weight=0.6),
    CategoricalField("creative", 130, zipf_a=1.0, weight=1.6),
    CategoricalField("advertiser", 9, zipf_a=0.7, weight=1.2),
    CategoricalField("usertag", 70, zipf_a=1.0, missing=0.3, weight=1.0),
    CategoricalField("ip", 1_800_000, zipf_a=0.6, weight=0.5),
)
_SPARSE_NUMERIC = (_count("slotprice", 5, 300, 0.0),)
_SPARSE_PAIRS = (Pair("advertiser", "slotid", 0.5), Pair("creative", "domain", 0.4))
_SPARSE_SOURCES = (
    "iPinYou RTB dataset (Liao et al., 2014; Zhang et al., 'Real-Time Bidding Benchmarking with "
    "iPinYou Dataset', 2014): impression logs with CTR ~0.08%; fields as its log format (weekday, "
    "hour, user agent, region, city, ad exchange, domain, URL, slot id/size/visibility/format, "
    "floor price, creative, advertiser, user tags, IP); cardinalities approximate"
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "criteo",
            "Kaggle Criteo: 13 heavy-tailed counts, 26 fields of 3 to 10M values",
            _CRITEO_SOURCES,
            _CRITEO_CATEGORICAL,
            _CRITEO_NUMERIC,
            _CRITEO_PAIRS,
            base_ctr=0.256,
            bayes_gain=0.25,
            events_per_s=45_840_617 / (7 * 86400),
        ),
        Profile(
            "avazu",
            "Avazu: hour of day, derived site/app fields, one device_id on 82%",
            _AVAZU_SOURCES,
            _AVAZU_CATEGORICAL,
            (),
            _AVAZU_PAIRS,
            base_ctr=0.17,
            bayes_gain=0.19,
            hour_amplitude=0.25,
            events_per_s=40_428_967 / (240 * 3600),
        ),
        Profile(
            "sparse_click",
            "RTB impressions as iPinYou's: 17 fields, a price, CTR 0.08%",
            _SPARSE_SOURCES,
            _SPARSE_CATEGORICAL,
            _SPARSE_NUMERIC,
            _SPARSE_PAIRS,
            base_ctr=0.0008,
            bayes_gain=0.12,
            hour_amplitude=0.2,
        ),
        Profile(
            "weak",
            "the criteo shape, its truth only 4.5% under the constant model",
            _CRITEO_SOURCES,
            _CRITEO_CATEGORICAL,
            _CRITEO_NUMERIC,
            (Pair("C2", "C6", 0.3),),
            base_ctr=0.256,
            bayes_gain=0.045,
            events_per_s=45_840_617 / (7 * 86400),
        ),
        Profile(
            "drift",
            "the criteo shape, weights rotating 0.3 rad/hour, 5% brand-new ids",
            _CRITEO_SOURCES,
            _CRITEO_CATEGORICAL,
            _CRITEO_NUMERIC,
            _CRITEO_PAIRS,
            base_ctr=0.256,
            bayes_gain=0.25,
            drift=0.3,
            fresh=0.05,
            events_per_s=45_840_617 / (7 * 86400),
        ),
    )
}
"""The named profiles, by name."""


def profile_stream(name: str, seed: int = 0, **overrides: Any) -> SyntheticStream:
    """A `SyntheticStream` of profile `name` (`PROFILES`); `overrides` replace
    any of its parameters (``base_ctr=0.2``, ``drift=0.1``, ``events_per_s=...``).
    `ValueError` names the profiles if `name` is none of them."""
    profile = PROFILES.get(name)
    if profile is None:
        raise ValueError(f"unknown profile {name!r}: one of {', '.join(PROFILES)}")
    return SyntheticStream(seed=seed, **{**profile.params(), **overrides})
