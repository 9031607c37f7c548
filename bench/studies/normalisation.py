"""Benchmark: a learnt per-feature normalisation of numeric values against
the declared divisor LR uses by default.

VW's normalized updates scale each coordinate by the largest magnitude its
feature has taken so far. On the streams of ``bench_quality.py`` this feeds
each numeric feature's value divided by the largest magnitude that feature
has had up to and including the event (``sign(x) log1p(|x|)`` first, or the
raw value), learnt progressively in event order, so a value never depends
on a later event; categorical features (value 1) are untouched. Each
normalised stream trains LR (`ps_core.model.learner.Learner`, FTRL, the
worker's mini-batches) over a small grid of FTRL's alpha and l1, beside the
default (`log1p/16` at the default FTRL). A point's ratio on a stream is its
log loss over the default's; the learnt normalisation wins if some point's
largest ratio over the streams is below 1.

Run: ``python bench/studies/normalisation.py [--quick]`` (``--quick``: 15k and
45k events, under a minute; full: about 8 minutes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: the shared helpers

from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log  # noqa: E402
from learning import Events, add_profiles_flags, logloss, streams  # noqa: E402

from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.model.models import DEFAULT_LINEAR_OPTIMIZER

log = progress_log("normalisation")

ALPHAS = (0.2, 0.35, 0.5)
L1S = (3.0, 5.0, 8.0)


def every_stream(args: argparse.Namespace) -> dict[str, Events]:
    """`bench_quality.streams` at the quick sizes, and at the full ones too
    unless `args.quick` (each named with its size)."""
    data: dict[str, Events] = {}
    for quick in (True,) if args.quick else (True, False):
        for name, events in streams(argparse.Namespace(**{**vars(args), "quick": quick})).items():
            data[f"{name}_{len(events) // 1000}k"] = events
    return data


def ftrl(alpha: float, l1: float) -> dict[str, Any]:
    """The default FTRL at this alpha and l1."""
    return {**DEFAULT_LINEAR_OPTIMIZER, "alpha": alpha, "l1": l1}


def normalised(events: Events, take_log: bool) -> Events:
    """`events` with each numeric value divided by the largest magnitude its
    feature has had so far (this event's included): the learnt scale."""
    top: dict[str, float] = {}
    out = []
    for e in events:  # a preprocessing pass of the benchmark, not a hot path
        features = dict(e["features"])
        for name, x in e["features"].items():
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                v = math.copysign(math.log1p(abs(x)), x) if take_log else float(x)
                m = top[name] = max(top.get(name, 0.0), abs(v))
                features[name] = v / m if m > 0 else 0.0
        out.append({**e, "features": features})
    return out


def points() -> Iterator[tuple[str, bool, float, float]]:
    """(name, log1p first, alpha, l1) of every learnt point tried."""
    for take_log in (True, False):
        for alpha in ALPHAS:
            for l1 in L1S:
                yield f"{'log1p' if take_log else 'raw'}/max,{alpha:g},{l1:g}", take_log, alpha, l1


def main(args: argparse.Namespace) -> dict[str, Any]:
    data = every_stream(args)
    default = f"{DEFAULT_NUMERIC},{DEFAULT_LINEAR_OPTIMIZER['alpha']:g},{DEFAULT_LINEAR_OPTIMIZER['l1']:g}"
    losses: dict[str, dict[str, float]] = {}
    for stream_name, events in data.items():
        row = {default: logloss("lr", events, DEFAULT_NUMERIC)}
        fed = {take_log: normalised(events, take_log) for take_log in (True, False)}
        for name, take_log, alpha, l1 in points():
            # Values arrive normalised: the model takes them as they are.
            row[name] = logloss("lr", fed[take_log], "raw", optimizer=ftrl(alpha, l1))
        losses[stream_name] = row
        best = min((p for p in row if p != default), key=row.__getitem__)
        log(
            f"{stream_name} ({len(events):,} events): default {row[default]:.5f}; best learnt {best} "
            f"{row[best]:.5f} ({row[best] / row[default]:.4f}x)"
        )
    ratios = {
        p: {s: losses[s][p] / losses[s][default] for s in losses} for p in next(iter(losses.values())) if p != default
    }
    worst = {p: max(r.values()) for p, r in ratios.items()}
    best_point = min(worst, key=worst.__getitem__)
    wins = worst[best_point] < 1.0
    log(
        f"learnt point with the smallest largest ratio vs the default: {best_point} {worst[best_point]:.4f}x; "
        f"learnt normalisation {'wins' if wins else 'does not win'} (ratios below 1 on every stream needed)"
    )
    return {
        "mode": bench_mode(args.quick),
        "events": {k: len(v) for k, v in data.items()},
        "default_point": default,
        "logloss_by_point": losses,
        "ratio_logloss_vs_default_by_point": ratios,
        "largest_ratio_vs_default_by_point": worst,
        "best_learnt_point": best_point,
        "best_learnt_largest_ratio_vs_default": worst[best_point],
        "learnt_wins": wins,
        "elapsed_s": elapsed_s(),
    }


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "A learnt per-feature normalisation of numeric values (VW's normalized updates, in values) against "
        "LR's declared divisor, on every quality stream.",
        "15k and 45k synthetic events (under a minute)",
        seed=7,
    )
    add_profiles_flags(p)
    args = p.parse_args()
    args.file = None  # what bench_quality.streams reads beside --quick and --seed
    return args


if __name__ == "__main__":
    print_result(main(parse_args()))
