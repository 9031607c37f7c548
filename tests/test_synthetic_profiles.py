"""Stream profiles shaped like real CTR logs (`ps_core.synthetic.profiles`) and
the declared-field generator under them: determinism, click rates, cardinalities,
missing values, learnability, memory, and events the worker accepts."""

from __future__ import annotations

import hashlib
import math
import time
import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pytest

from ps_core.model.events import decode_message
from ps_core.model.featurizer import FeatureHasher
from ps_core.synthetic import PROFILES, CategoricalField, Pair, SyntheticStream, profile_stream

N = 16_384  # two generation blocks per stream


def _entropy(p: npt.NDArray[np.float64]) -> float:
    q = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(q * np.log(q) + (1 - q) * np.log1p(-q)))


def _day_stream(name: str, seed: int = 0, **kw: Any) -> SyntheticStream:
    """N events spread over a whole day, so the daily cycle averages out."""
    return profile_stream(name, seed=seed, events_per_s=N / 86400.0, **kw)


_EVENTS: dict[str, list[dict[str, Any]]] = {}


def _events(name: str) -> list[dict[str, Any]]:
    if name not in _EVENTS:
        _EVENTS[name] = _day_stream(name).batch(N)
    return _EVENTS[name]


@pytest.mark.parametrize("name", list(PROFILES))
def test_same_seed_same_events_whatever_the_batch_sizes(name: str) -> None:
    a = _events(name)[:9000]  # one batch of N (seed 0)
    s = _day_stream(name)
    b = s.batch(1) + s.batch(4999) + s.batch(4000)  # across the first block's end
    assert a == b
    other = _day_stream(name, seed=1).batch(200)
    assert [e["features"] for e in other] != [e["features"] for e in a[:200]]


@pytest.mark.parametrize("name", list(PROFILES))
def test_click_rate_and_bayes_log_loss_are_the_profiles(name: str) -> None:
    prof = PROFILES[name]
    events = _events(name)
    p = np.array([e["p_true"] for e in events])
    y = np.array([e["label"] for e in events])
    # The mean of p_true is the profile's rate within a few percent (sampling of
    # the values seen); labels are Bernoulli draws of it (4 sigma).
    assert abs(p.mean() / prof.base_ctr - 1) < 0.12, (p.mean(), prof.base_ctr)
    assert abs(y.mean() - p.mean()) < 4 * math.sqrt(p.mean() * (1 - p.mean()) / N) + 1e-4
    # The truth's expected log loss against the constant model's (entropy of p_true).
    gain = 1 - _entropy(p) / _entropy(np.array([p.mean()]))
    assert abs(gain - prof.bayes_gain) < 0.25 * prof.bayes_gain, (gain, prof.bayes_gain)
    print(f"{name}: ctr {p.mean():.4f} (labels {y.mean():.4f}) bayes gain {gain:.3f} (target {prof.bayes_gain})")


def test_weak_profile_is_a_few_percent_under_the_constant() -> None:
    p = np.array([e["p_true"] for e in _events("weak")])
    gain = 1 - _entropy(p) / _entropy(np.array([p.mean()]))
    assert 0.03 <= gain <= 0.06


@pytest.mark.parametrize("name", list(PROFILES))
def test_cardinalities_and_missing_rates_are_as_declared(name: str) -> None:
    prof = PROFILES[name]
    events = _events(name)
    present = {f.name: [e["features"][f.name] for e in events if f.name in e["features"]] for f in prof.categorical}
    distinct = {k: len(set(v)) for k, v in present.items()}
    for f in prof.categorical:
        assert distinct[f.name] <= f.cardinality + (N if name == "drift" else 0)  # brand-new ids on top
        rate = 1 - len(present[f.name]) / N
        assert abs(rate - f.missing) < 4 * math.sqrt(f.missing * (1 - f.missing) / N) + 2e-3, (f.name, rate)
    for x in prof.numeric:
        rate = 1 - sum(x.name in e["features"] for e in events) / N
        assert abs(rate - x.missing) < 4 * math.sqrt(x.missing * (1 - x.missing) / N) + 2e-3, (x.name, rate)
    if name == "drift":
        return
    # Fields drawn on their own: ten times the values declared, more values seen.
    plain = [f for f in prof.categorical if f.parent is None and not f.head and not f.hour]
    for a in plain:
        for b in plain:
            if a.cardinality >= 10 * b.cardinality:
                assert distinct[a.name] > distinct[b.name], (a.name, b.name, distinct)
        if a.cardinality <= 50:
            assert distinct[a.name] == a.cardinality  # every value of a small field shows up
        if a.cardinality >= 1_000_000:  # mostly values not seen before in the sample
            assert distinct[a.name] > 0.5 * len(present[a.name]), (a.name, distinct[a.name])


def test_criteo_counts_are_heavy_tailed_with_a_few_negatives() -> None:
    events = _events("criteo")
    cols = {
        x.name: np.array([e["features"][x.name] for e in events if x.name in e["features"]])
        for x in PROFILES["criteo"].numeric
    }
    medians = {k: float(np.median(v)) for k, v in cols.items()}
    assert min(medians.values()) <= 1 and max(medians.values()) >= 100
    assert max(float(v.max()) for v in cols.values()) >= 100_000
    negative = {k for k, v in cols.items() if (v < 0).any()}
    assert negative == {"I2"} and 0 < float((cols["I2"] < 0).mean()) < 0.02


def test_avazu_fields_are_shaped_as_avazu() -> None:
    events = _events("avazu")
    feats = [e["features"] for e in events]
    assert len(feats[0]) == 22 and all(isinstance(v, str) for v in feats[0].values())
    ids = [f["device_id"] for f in feats]
    top = max(set(ids), key=ids.count)
    assert 0.78 < ids.count(top) / N < 0.86
    # The hour field is the hour of day of ts, and the click rate follows a daily cycle.
    hours = np.array([int(f["hour"]) for f in feats])
    ts = np.array([e["ts"] for e in events])
    assert (hours == (ts % 86400 // 3600)).all()
    p = np.array([e["p_true"] for e in events])
    by_hour = np.array([p[hours == h].mean() for h in range(24)])
    assert by_hour.max() / by_hour.min() > 1.2
    # A site's domain is mostly a function of the site (90%): most events
    # carry their site's most frequent domain.
    pairs: dict[tuple[str, str], int] = {}
    for f in feats:
        pairs[f["site_id"], f["site_domain"]] = pairs.get((f["site_id"], f["site_domain"]), 0) + 1
    mode: dict[str, int] = {}
    for (site, _), count in pairs.items():
        mode[site] = max(mode.get(site, 0), count)
    assert 0.85 < sum(mode.values()) / N < 0.97


@pytest.mark.parametrize("name", list(PROFILES))
def test_events_pass_the_workers_validation(name: str) -> None:
    events = profile_stream(name, seed=1).batch(3000)
    # As the worker gets them: one JSON message each (as the producer sends
    # them), decoded, then validated and hashed.
    decoded = [ev for e in events for ev in decode_message(orjson.dumps(e))]
    for numeric in ("log1p", "raw"):
        batch, errors = FeatureHasher("ctr", numeric=numeric).featurize(decoded, json_types=True)
        assert not errors
        assert len(batch.labels) == len(events)


def test_criteo_profile_memory_is_bounded_and_speed_is_reported() -> None:
    tracemalloc.start()
    try:
        t = time.perf_counter()
        stream = profile_stream("criteo")
        built = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Fields of 10M values cost no table of that length (a float64 one alone is 80 MB).
    assert peak < 200e6, peak
    t = time.perf_counter()
    stream.batch(N)
    rate = N / (time.perf_counter() - t)
    print(f"criteo: built in {built:.2f} s, peak {peak / 1e6:.0f} MB; {rate:,.0f} events/s")


def test_unknown_profile_and_overrides() -> None:
    with pytest.raises(ValueError, match="unknown profile 'kdd'.*criteo"):
        profile_stream("kdd")
    p = np.array([e["p_true"] for e in _day_stream("avazu", base_ctr=0.3).batch(N)])
    assert abs(p.mean() - 0.3) < 0.03


def test_declared_fields_are_checked() -> None:
    c = CategoricalField("a", 10)
    for bad in (
        {"categorical_fields": (c, c)},
        {"categorical_fields": (CategoricalField("a", 0),)},
        {"categorical_fields": (CategoricalField("h", 12, hour=True),)},
        {"categorical_fields": (c, CategoricalField("b", 5, parent="x"))},
        {"categorical_fields": (c, CategoricalField("b", 5, parent="a", head=0.5))},
        {"categorical_fields": (c,), "pairs": (Pair("a", "z", 0.1),)},
        {"categorical_fields": (c,), "bayes_gain": 1.0},
        {"pairs": (Pair("a", "b", 0.1),)},
    ):
        with pytest.raises(ValueError):
            SyntheticStream(**bad)


def test_the_default_stream_is_what_it_was() -> None:
    """The Criteo-like default stream is byte-for-byte the one the tests and
    benchmarks were written against (digests of the generator before fields
    could be declared)."""
    digest = {
        (7, 0.0, 10_000): "4add46aae982a41e10f7ef1522fd462c14d890bcccf7e2805b983817d8dc2ae8",
        (4, 0.05, 10_000): "7c5f1751c2dba8dd0f84129bb806ad746dce8b1c4b7b02e2ed94c77db690387d",
        (1, 0.0, 100_000): "1d2f9fae547333c4da593f91816aaf481fcab063d192bbfd82d82200f0f346cf",
    }
    for (seed, fresh, vocab), want in digest.items():
        stream = SyntheticStream(seed=seed, fresh=fresh, vocab=vocab)
        got = hashlib.sha256(orjson.dumps(stream.batch(1000) + stream.batch(2000))).hexdigest()
        assert got == want


@pytest.mark.parametrize(("name", "a", "b"), [("criteo", "C14", "C17"), ("avazu", "hour", "site_category"),
                                              ("sparse_click", "advertiser", "slotid")])  # fmt: skip
def test_pairs_make_the_truth_non_additive(name: str, a: str, b: str) -> None:
    """A declared pair is an interaction: the truth's mean logit over the 4 × 4
    most frequent values of the two fields is not row effect plus column effect
    (two-way residual), as it is, up to sampling, without the pair."""

    def residual(**kw: Any) -> float:
        events = _day_stream(name, **kw).batch(N)
        q = np.array([e["p_true"] for e in events])
        logit = np.log(q / (1 - q))
        va = np.array([e["features"].get(a, "") for e in events], dtype=object)
        vb = np.array([e["features"].get(b, "") for e in events], dtype=object)
        tops = []
        for v in (va, vb):
            values, counts = np.unique(v, return_counts=True)
            tops.append(values[np.argsort(-counts)[:4]])
        m = np.array([[logit[(va == x) & (vb == y)].mean() for y in tops[1]] for x in tops[0]])
        r = m - m.mean(axis=1, keepdims=True) - m.mean(axis=0, keepdims=True) + m.mean()
        return float(r.std())

    with_pair, without = residual(), residual(pairs=())
    assert with_pair > 2.5 * without, (with_pair, without)


def test_drift_profile_rotates_the_truth_and_keeps_its_rate() -> None:
    # One event a second: 0.3 rad an hour turns ~1.4 rad over N events.
    moving = profile_stream("drift", events_per_s=1.0).batch(N)
    still = profile_stream("drift", events_per_s=1.0, drift=0.0).batch(N)
    assert [e["features"] for e in moving] == [e["features"] for e in still]  # the same draws

    def logit(events: list[dict[str, Any]]) -> npt.NDArray[np.float64]:
        q = np.array([e["p_true"] for e in events])
        out: npt.NDArray[np.float64] = np.log(q / (1 - q))
        return out

    early, late = slice(0, 2000), slice(N - 4000, N)
    assert np.corrcoef(logit(moving[early]), logit(still[early]))[0, 1] > 0.95
    assert np.corrcoef(logit(moving[late]), logit(still[late]))[0, 1] < 0.6
    p_late = np.mean([e["p_true"] for e in moving[late]])
    assert abs(p_late / PROFILES["drift"].base_ctr - 1) < 0.12, p_late
