"""Benchmark: the sweep that chose LR's defaults: FTRL's alpha and l1, and
how numeric features are fed.

On the streams of ``bench_quality.py`` (the synthetic generator with a long
tail, 5% fresh ids and drift, its counts acting through ``log1p`` or
linearly; 15k and 45k events with ``--quick``, those and 200k and 1M
without, so one setting serves short and long streams alike), each
(alpha, l1, numeric) of a grid trains LR through the same code as a worker
(`ps_core.model.learner.Learner`: 256-event mini-batches after the ramp),
beta and l2 staying 1; numeric is ``log1p`` divided by 1, 4, 8 or 16
(`ps_core.model.hasher.NUMERIC`). A point's regret
on a stream is its progressive log loss over the best point's on that
stream; the default is the point whose largest regret over the streams is
smallest (one setting for every stream length, not the best of one). The
same run measures the chosen point without the mini-batch ramp and per event
(``--per-event``: every stream at mini-batches of 1), so the table says what
the ramp buys and what mini-batches still cost.

Run: ``python bench/bench_linear_sweep.py [--quick]`` (``--quick``: under a
minute; full: about 15 minutes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from bench_quality import Events, add_profiles_flags, streams
from bench_sweep import logloss
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

from ps_core.model.hasher import DEFAULT_NUMERIC
from ps_core.model.models import DEFAULT_LINEAR_OPTIMIZER

log = progress_log("bench_linear_sweep")

ALPHAS = (0.15, 0.2, 0.3, 0.4)
L1S = (1.0, 2.0, 4.0, 8.0)
NUMERICS = ("log1p", "log1p/4", "log1p/8", "log1p/16")


def ftrl(alpha: float, l1: float) -> dict[str, Any]:
    """An FTRL config of the grid: beta and l2 as the default's."""
    return {**DEFAULT_LINEAR_OPTIMIZER, "alpha": alpha, "l1": l1}


def every_stream(args: argparse.Namespace) -> dict[str, Events]:
    """`bench_quality.streams` at the quick sizes, and at the full ones too
    unless `args.quick` (each named with its size)."""
    data: dict[str, Events] = {}
    for quick in (True,) if args.quick else (True, False):
        for name, events in streams(argparse.Namespace(**{**vars(args), "quick": quick})).items():
            data[f"{name}_{len(events) // 1000}k"] = events
    return data


def main(args: argparse.Namespace) -> dict[str, Any]:
    data = every_stream(args)
    grid = list(itertools.product(args.alphas, args.l1s, args.numerics))
    points = [f"{a:g},{b:g},{n}" for a, b, n in grid]
    losses: dict[str, dict[str, float]] = {}
    for stream_name, events in data.items():
        by_point = {}
        for point, (alpha, l1, numeric) in zip(points, grid):
            by_point[point] = logloss("lr", events, numeric, optimizer=ftrl(alpha, l1))
        losses[stream_name] = by_point
        best = min(by_point, key=by_point.__getitem__)
        log(
            f"{stream_name} ({len(events):,} events): best alpha,l1,numeric {best} {by_point[best]:.5f}; "
            + ", ".join(f"{p} {v:.5f}" for p, v in by_point.items())
        )
    regret = {p: max(losses[s][p] / min(losses[s].values()) for s in losses) for p in points}
    chosen = min(regret, key=regret.__getitem__)
    a, b, numeric = chosen.split(",")
    alpha, l1 = float(a), float(b)
    default = f"{DEFAULT_LINEAR_OPTIMIZER['alpha']:g},{DEFAULT_LINEAR_OPTIMIZER['l1']:g},{DEFAULT_NUMERIC}"
    log(
        "largest regret by point: "
        + ", ".join(f"{p} {r:.4f}" for p, r in sorted(regret.items(), key=lambda kv: kv[1]))
        + f"; chosen {chosen}; the default is {default}"
    )
    # The chosen point without the ramp (and per event): what the ramp buys, what mini-batches still cost.
    without_ramp, per_event = {}, {}
    for stream_name, events in data.items():
        without_ramp[stream_name] = logloss("lr", events, numeric, optimizer=ftrl(alpha, l1), ramp=0)
        line = (
            f"{stream_name}: chosen {losses[stream_name][chosen]:.5f}, without the ramp {without_ramp[stream_name]:.5f}"
        )
        if args.per_event:
            per_event[stream_name] = logloss("lr", events, numeric, optimizer=ftrl(alpha, l1), mini_batch=1)
            line += f", per event {per_event[stream_name]:.5f} ({losses[stream_name][chosen] / per_event[stream_name]:.4f}x)"
        log(line)
    return {
        "mode": bench_mode(args.quick),
        "events": {k: len(v) for k, v in data.items()},
        "logloss_by_alpha_l1_numeric": losses,
        "largest_regret_by_alpha_l1_numeric": regret,
        "chosen_alpha_l1_numeric": chosen,
        "default_alpha_l1_numeric": default,
        "chosen_logloss_without_ramp": without_ramp,
        "chosen_logloss_per_event": per_event,
        "ratio_logloss_vs_per_event": {s: losses[s][chosen] / v for s, v in per_event.items()},
        "elapsed_s": elapsed_s(),
    }


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "The sweep behind LR's defaults: log loss by (FTRL alpha, l1, numeric feed) on every quality stream.",
        "15k and 45k synthetic events (under a minute)",
        seed=7,
    )
    p.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS), help="FTRL alphas to try")
    p.add_argument("--l1s", type=float, nargs="+", default=list(L1S), help="FTRL l1s to try")
    p.add_argument("--numerics", nargs="+", default=list(NUMERICS), help="numeric feeds to try (raw|log1p[/D])")
    p.add_argument("--per-event", action="store_true", help="also train the chosen point per event (slow)")
    add_profiles_flags(p)
    args = p.parse_args()
    args.file = None  # what bench_quality.streams reads beside --quick and --seed
    return args


if __name__ == "__main__":
    print_result(main(parse_args()))
