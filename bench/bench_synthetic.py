"""Benchmark: the synthetic stream profiles' figures and generation speed.

For the default stream and each profile of ``ps_core.synthetic.PROFILES``:
the memory and time to build it (tracemalloc peak), its generation speed
(events/s of ``batch``, best and median of ``--runs`` runs over fresh
streams), and the figures docs/synthetic.md quotes, measured on ``--events``
events spread over one day of event time (so an hour-of-day cycle averages
out): click rate, the truth's log loss (from the labels, and its expected
value, the entropy of ``p_true``) against the constant model's, distinct
values per categorical field, missing rates, count fields' medians and
maxima; and how much of the gap to the truth a linear model closes
(``ps_core.Learner`` LR, FTRL defaults) after 5k, 50k and 300k events
(``--quick``: 5k and 50k, and 20k events per figure), on 20k held-out events.

Run: ``python bench/bench_synthetic.py [--quick] [--profiles criteo avazu]``;
the last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

from ps_core.model.learner import Learner
from ps_core.synthetic import PROFILES, SyntheticStream, profile_stream

log = progress_log("bench_synthetic")

DEFAULT = "default"
"""The stream without a profile (`SyntheticStream()`)."""


def _stream(name: str, seed: int, **kw: Any) -> SyntheticStream:
    return SyntheticStream(seed=seed, **kw) if name == DEFAULT else profile_stream(name, seed, **kw)


def _logloss(p: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    q = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log1p(-q)))


def _entropy(p: npt.NDArray[np.float64]) -> float:
    q = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(q * np.log(q) + (1 - q) * np.log1p(-q)))


def speed(name: str, seed: int, events: int, runs: int) -> dict[str, float]:
    """Build cost and events/s of `batch` (fresh streams, `runs` times)."""
    tracemalloc.start()
    t = time.perf_counter()
    stream = _stream(name, seed)
    build_s = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rates = []
    for r in range(runs):
        stream = _stream(name, seed + r)
        t = time.perf_counter()
        for _ in stream.iter_batches(events, 10_000):
            pass
        rates.append(events / (time.perf_counter() - t))
    return {
        "build_s": build_s,
        "build_peak_mb": peak / 1e6,
        "events_per_s_best": max(rates),
        "events_per_s_median": statistics.median(rates),
    }


def shape(name: str, seed: int, n: int) -> dict[str, Any]:
    """The stream's figures over `n` events spread over one day."""
    events = _stream(name, seed, events_per_s=n / 86400.0).batch(n)
    p = np.array([e["p_true"] for e in events])
    y = np.array([e["label"] for e in events], dtype=np.float64)
    const = _entropy(np.array([p.mean()]))
    names = sorted({k for e in events[:2000] for k in e["features"]}, key=lambda k: (k[0] not in "I", len(k), k))
    distinct, missing, counts = {}, {}, {}
    for f in names:
        col = [e["features"][f] for e in events if f in e["features"]]
        missing[f] = round(1 - len(col) / n, 4)
        if col and isinstance(col[0], str):
            distinct[f] = len(set(col))
        else:
            v = np.array(col)
            counts[f] = {"median": float(np.median(v)), "max": float(v.max()), "negative": float((v < 0).mean())}
    return {
        "ctr": float(p.mean()),
        "label_rate": float(y.mean()),
        "constant_logloss": const,
        "bayes_logloss_expected": _entropy(p),
        "bayes_gain": 1 - _entropy(p) / const,
        "bayes_logloss_labels": _logloss(p, y),
        "constant_logloss_labels": _logloss(np.full(n, y.mean()), y),
        "distinct": distinct,
        "missing": {k: v for k, v in missing.items() if v},
        "counts": counts,
    }


def learnability(name: str, seed: int, sizes: list[int]) -> dict[str, float]:
    """Held-out log loss gain over the constant of LR after each of `sizes` events."""
    stream = _stream(name, seed)
    train = stream.batch(max(sizes))
    test = stream.batch(20_000)
    y = np.array([e["label"] for e in test], dtype=np.float64)
    const = _logloss(np.full(len(y), np.mean([e["label"] for e in train])), y)
    out = {"bayes_gain": 1 - _logloss(np.array([e["p_true"] for e in test]), y) / const}
    learner, done = Learner("lr"), 0
    for n in sorted(sizes):
        learner.learn(train[done:n])
        done = n
        out[f"lr_gain_{n}"] = 1 - _logloss(learner.predict(test), y) / const
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    names = args.profiles or [DEFAULT, *PROFILES]
    sizes = [5_000, 50_000] if args.quick else [5_000, 50_000, 300_000]
    results: dict[str, Any] = {}
    for name in names:
        r: dict[str, Any] = {"speed": speed(name, args.seed, args.events, args.runs)}
        s = r["speed"]
        log(
            f"{name}: built in {s['build_s']:.2f} s (peak {s['build_peak_mb']:.0f} MB); "
            f"{s['events_per_s_median']:,.0f} events/s median, {s['events_per_s_best']:,.0f} best"
        )
        r["shape"] = shape(name, args.seed, args.events)
        sh = r["shape"]
        log(
            f"  CTR {sh['ctr']:.4f}; truth's log loss {sh['bayes_logloss_expected']:.4f} against the constant's "
            f"{sh['constant_logloss']:.4f} ({100 * sh['bayes_gain']:.1f}% under)"
        )
        if not args.no_learn:
            r["learn"] = learnability(name, args.seed, sizes)
            log("  LR gain over the constant: " + ", ".join(f"{k} {v:.3f}" for k, v in r["learn"].items()))
        results[name] = r
    return {"mode": bench_mode(args.quick), "events": args.events, "results": results, "elapsed_s": elapsed_s()}


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "Build cost, generation speed and shape figures of the synthetic stream profiles.",
        "20k events per figure, LR learnt on 5k and 50k events only (about half a minute)",
        seed=0,
        record=True,
    )
    p.add_argument("--profiles", nargs="+", choices=[DEFAULT, *PROFILES], help="which (default: all and the default)")
    p.add_argument("--events", type=int, help="events per speed run and for the figures (default 50000; quick 20000)")
    p.add_argument("--runs", type=int, default=3, help="speed runs per stream (default 3)")
    p.add_argument("--no-learn", action="store_true", help="skip the LR learnability figures")
    args = p.parse_args()
    if args.events is None:
        args.events = 20_000 if args.quick else 50_000
    if args.events < 1 or args.runs < 1:
        p.error("--events and --runs must be >= 1")
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    print_result(main(ARGS), ARGS)
