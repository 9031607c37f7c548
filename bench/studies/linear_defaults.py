"""Benchmark: the sweep that chooses LR's defaults, without overfitting the choice.

Streams: every profile of `ps_core.synthetic` (``PROFILES``: shaped like
Criteo, Avazu, RTB logs with rare clicks, weak signals, drift) and the
generator's own stream as ``bench_quality.py`` runs it (``quality``), each
at two sizes and at seeds of its half. The streams split in two halves by
profile *and* seed (`HALVES`): the sweep chooses on the tuning half only
and reports the held-out half, whose profiles and seeds it never saw.

Grid: LR through the same code as a worker (`Learner`: 256-event
mini-batches after the ramp) at each FTRL (alpha, l1) (beta and l2 1) and
numeric feed, and at each coin-betting (wealth, scale) point. A point's
regret on a stream is its progressive log loss over the best point's on that
stream; the chosen default is the point whose largest regret over the
tuning half is smallest (one setting within a bound everywhere, rather than
the best of one stream). Reported for both halves: each point's largest
regret, the chosen point's and today's default's ratios per stream, and
their ratio to the better of Vowpal Wabbit and River on the same events
(``bench_quality.py``'s runners).

Run: ``python bench/studies/linear_defaults.py [--quick]`` (``--quick``: one seed
per half, a smaller grid, under two minutes; full: two seeds per half,
about ten minutes). Needs ``pip install -e '.[quality]'`` for VW and River
(``--no-baselines`` skips them). The last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: the shared helpers

from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log  # noqa: E402
from learning import Events, logloss, measure, profile_events, stream_size  # noqa: E402

from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.model.models import DEFAULT_LINEAR_OPTIMIZER
from ps_core.store.optim import make_optimizer

log = progress_log("linear_defaults")

HALVES: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "tuning": (("avazu", "sparse_click", "drift"), (1, 2)),
    "held_out": (("criteo", "weak", "quality"), (3, 4)),
}
"""Each half's profiles and seeds: a held-out stream differs from every
tuning stream in its profile and its seed. Criteo's shape is held out (the
tuning half has it only drifting); so is the generator's own stream."""

ALPHAS = (0.05, 0.1, 0.2, 0.35)
BETAS = (0.1, 1.0)
L1S = (0.5, 1.0, 2.0, 5.0)
L2S = (0.1, 1.0)
NUMERICS = (DEFAULT_NUMERIC,)
COINS = ((1.0, 0.125), (4.0, 0.0625), (4.0, 0.125), (4.0, 0.25), (8.0, 0.125))
"""Coin betting's (wealth, scale) points."""
MIXTURES: dict[str, tuple[tuple[float, float], ...]] = {
    "3": ((0.05, 0.5), (0.2, 0.5), (0.35, 5.0)),
    "4": ((0.05, 0.5), (0.1, 0.5), (0.2, 0.5), (0.35, 5.0)),
    "5": ((0.05, 0.5), (0.1, 0.5), (0.2, 0.5), (0.35, 0.5), (0.35, 5.0)),
}
"""Mixtures of FTRL learners (`ftrl_mix`, beta 0.1, l2 1): each learner's (alpha, l1)."""
QUICK = {
    "alphas": (0.1, 0.2, 0.35),
    "betas": (0.1,),
    "l1s": (0.5, 2.0, 5.0),
    "l2s": (1.0,),
    "numerics": (DEFAULT_NUMERIC,),
    "coins": ((4.0, 0.025),),
    "mixtures": ("3", "5"),
}


def point_name(opt: dict[str, Any], numeric: str) -> str:
    """A grid point's name: ``ftrl:alpha,l1,numeric`` or ``coin:wealth,scale,numeric``."""
    if opt["name"] == "ftrl":
        return f"ftrl:{opt['alpha']:g},{opt['beta']:g},{opt['l1']:g},{opt['l2']:g},{numeric}"
    if opt["name"] == "ftrl_mix":
        learners = [f"{opt[f'alpha_{i}']:g}/{opt.get(f'l1_{i}', 0.5):g}" for i in range(1, 7) if f"alpha_{i}" in opt]
        return f"mix:{'+'.join(learners)},{numeric}"
    return f"coin:{opt['wealth']:g},{opt['scale']:g},{numeric}"


def grid(args: argparse.Namespace) -> dict[str, tuple[dict[str, Any], str]]:
    """Every point of the sweep: name → (optimizer, numeric feed)."""
    points: dict[str, tuple[dict[str, Any], str]] = {}
    for numeric in args.numerics:
        for alpha, beta, l1, l2 in itertools.product(args.alphas, args.betas, args.l1s, args.l2s):
            opt = {"name": "ftrl", "alpha": alpha, "beta": beta, "l1": l1, "l2": l2}
            points[point_name(opt, numeric)] = (opt, numeric)
        for wealth, scale in args.coins:
            opt = {"name": "coin", "wealth": wealth, "lipschitz": 1.0, "scale": scale}
            points[point_name(opt, numeric)] = (opt, numeric)
        for mixture in args.mixtures:
            opt = mixture_spec(MIXTURES[mixture])
            points[point_name(opt, numeric)] = (opt, numeric)
    return points


def mixture_spec(learners: tuple[tuple[float, float], ...]) -> dict[str, Any]:
    """The `ftrl_mix` optimizer of these (alpha, l1) learners at beta 0.1, l2 1."""
    opt: dict[str, Any] = {"name": "ftrl_mix", "beta": 0.1, "l2": 1.0}
    for i, (alpha, l1) in enumerate(learners, start=1):
        opt[f"alpha_{i}"], opt[f"l1_{i}"] = alpha, l1
    return opt


def half_streams(args: argparse.Namespace) -> dict[str, dict[str, Events]]:
    """Each half's streams, named ``profile_s<seed>_<thousands>k``."""
    out: dict[str, dict[str, Events]] = {}
    for half, (profiles, seeds) in HALVES.items():
        out[half] = {}
        for profile, seed, size in itertools.product(profiles, seeds[: args.seeds], args.sizes):
            n = stream_size(profile, size)
            out[half][f"{profile}_s{seed}_{n // 1000}k"] = profile_events(profile, seed, n)
    return out


def largest_regret(losses: dict[str, dict[str, float]], point: str) -> float:
    return max(by[point] / min(by.values()) for by in losses.values())


def main(args: argparse.Namespace) -> dict[str, Any]:
    points = grid(args)
    default_opt = make_optimizer(dict(DEFAULT_LINEAR_OPTIMIZER)).spec()  # its hyperparameters spelt out
    default = point_name(default_opt, DEFAULT_NUMERIC)
    points.setdefault(default, (default_opt, DEFAULT_NUMERIC))
    data = half_streams(args)
    losses: dict[str, dict[str, dict[str, float]]] = {}
    baselines: dict[str, dict[str, float]] = {}
    for half, streams in data.items():
        losses[half] = {}
        for stream_name, events in streams.items():
            by_point = {p: logloss("lr", events, numeric, optimizer=opt) for p, (opt, numeric) in points.items()}
            losses[half][stream_name] = by_point
            best = min(by_point, key=by_point.__getitem__)
            line = f"{half} {stream_name}: best {best} {by_point[best]:.5f}, default {by_point[default]:.5f}"
            if args.baselines:
                baselines[stream_name] = {n: measure(n, events)["logloss"] for n in ("vw", "river_lr")}
                line += ", " + ", ".join(f"{n} {v:.5f}" for n, v in baselines[stream_name].items())
            log(line)
    regret = {half: {p: largest_regret(losses[half], p) for p in points} for half in losses}
    chosen = min(points, key=lambda p: regret["tuning"][p])
    ftrl_points = [p for p in points if p.startswith("ftrl:")]
    coin_points = [p for p in points if p.startswith("coin:")]
    best_coin = min(coin_points, key=lambda p: regret["tuning"][p]) if coin_points else None
    mix_points = [p for p in points if p.startswith("mix:")]
    for half in losses:
        log(
            f"{half}: largest regret, best first: "
            + ", ".join(f"{p} {r:.4f}" for p, r in sorted(regret[half].items(), key=lambda kv: kv[1])[:8])
        )
    log(
        f"chosen on the tuning half: {chosen} (tuning {regret['tuning'][chosen]:.4f}, "
        f"held out {regret['held_out'][chosen]:.4f}); today's default {default} "
        f"(tuning {regret['tuning'][default]:.4f}, held out {regret['held_out'][default]:.4f})"
    )

    def ratios(point: str) -> dict[str, dict[str, float]]:
        """Per stream: the point's log loss over the stream's best FTRL point
        and over the better of VW and River."""
        out: dict[str, dict[str, float]] = {}
        for half in losses:
            for s, by in losses[half].items():
                r = {"vs_best_tuned_ftrl": by[point] / min(by[p] for p in ftrl_points)}
                if s in baselines:
                    r["vs_best_of_vw_river"] = by[point] / min(baselines[s].values())
                out[s] = r
        return out

    report = {"chosen": ratios(chosen), "default": ratios(default)}
    if best_coin is not None:
        report["coin"] = ratios(best_coin)
    for p in mix_points:
        report[p] = ratios(p)
    for name, r in report.items():
        worst_ftrl = max(v["vs_best_tuned_ftrl"] for v in r.values())
        worst_vw = max((v["vs_best_of_vw_river"] for v in r.values() if "vs_best_of_vw_river" in v), default=0.0)
        log(f"{name}: worst ratio vs best tuned FTRL {worst_ftrl:.4f}, vs best of VW and River {worst_vw:.4f}")
    return {
        "mode": bench_mode(args.quick),
        "halves": {h: {"profiles": list(p), "seeds": list(s[: args.seeds])} for h, (p, s) in HALVES.items()},
        "events": {s: len(ev) for streams in data.values() for s, ev in streams.items()},
        "logloss_by_point": losses,
        "baseline_logloss": baselines,
        "largest_regret_by_point": regret,
        "chosen_point": chosen,
        "default_point": default,
        "best_coin_point": best_coin,
        "ratios": report,
        "elapsed_s": elapsed_s(),
    }


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "The sweep behind LR's defaults: chosen on half the streams, reported on the other half.",
        "one seed per half at 8k and 20k events (rare clicks 125k), a 3x3 FTRL grid at beta 0.1, l2 1 (about a minute)",
    )
    p.add_argument("--alphas", type=float, nargs="+", help="FTRL alphas to try")
    p.add_argument("--betas", type=float, nargs="+", help="FTRL betas to try")
    p.add_argument("--l1s", type=float, nargs="+", help="FTRL l1s to try")
    p.add_argument("--l2s", type=float, nargs="+", help="FTRL l2s to try")
    p.add_argument("--numerics", nargs="+", help="numeric feeds to try (raw|log1p[/D])")
    p.add_argument("--coins", nargs="*", help="coin (wealth,scale) points to try, e.g. 4,0.025 (none: FTRL only)")
    p.add_argument("--mixtures", nargs="*", choices=sorted(MIXTURES), help="mixtures of FTRL learners to try, by size")
    p.add_argument("--no-baselines", dest="baselines", action="store_false", help="skip VW and River")
    args = p.parse_args()
    quick = (
        QUICK
        if args.quick
        else {
            "alphas": ALPHAS,
            "betas": BETAS,
            "l1s": L1S,
            "l2s": L2S,
            "numerics": NUMERICS,
            "coins": COINS,
            "mixtures": tuple(MIXTURES),
        }
    )
    args.alphas = tuple(args.alphas or quick["alphas"])
    args.l1s = tuple(args.l1s or quick["l1s"])
    args.betas = tuple(args.betas or quick["betas"])
    args.l2s = tuple(args.l2s or quick["l2s"])
    args.numerics = tuple(args.numerics or quick["numerics"])
    coins = quick["coins"] if args.coins is None else [tuple(float(v) for v in c.split(",")) for c in args.coins]
    args.coins = tuple(coins)
    args.mixtures = tuple(quick["mixtures"] if args.mixtures is None else args.mixtures)
    args.seeds = 1 if args.quick else 2
    args.sizes = (8_000, 20_000) if args.quick else (8_000, 40_000)
    return args


if __name__ == "__main__":
    print_result(main(parse_args()))
