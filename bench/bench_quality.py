"""Benchmark: how well ctrps learns a click stream, against the learners people
would pick instead — Vowpal Wabbit and River — on the same events, in the
same order, each event predicted before it is learnt from (progressive
validation).

Learners:

- ``ctrps_lr`` and ``ctrps_fm``: ``ps_core.Learner``, the worker's own async
  training step (hashing, mini-batches of 256, the linear part's mixture of
  FTRL learners and the FM's AdaGrad embeddings, its defaults,
  numeric features as ``sign(x) log1p(|x|)``, the default) in this process:
  the same training code as a worker, without Kafka or shards;
  ``ctrps_lr_raw`` and ``ctrps_fm_raw``: the same with numeric features fed
  as sent (``--numeric raw``), the sweep that chose the default;
  ``ctrps_lr_coin``: LR with coin betting at its defaults, the optimizer
  without a learning rate; ``ctrps_lr_ftrl``: LR with one FTRL learner
  (the former default) where the default is a mixture of five.
- ``vw``: Vowpal Wabbit through its Python API (``--loss_function logistic
  --link logistic -b 22``, its default adaptive, normalized updates), one
  example at a time; categoricals as ``name=value`` tokens, numbers as
  ``name:value``.
- ``river_lr``: River's ``LogisticRegression`` with ``FTRLProximal``;
  ``river_fm``: River's ``FMClassifier`` (8 factors); features as dicts.
  ``river_fm`` learns ~460 events a second here (and its default SGD
  diverges on raw counts), so it runs only when asked (``--learners``), on
  each stream's first ``--slow-limit`` events.

The inputs of VW and River (text lines, dicts) are built before their clock
starts; ctrps's clock includes its own hashing of the event dicts.

Streams: the synthetic generator (a hidden logistic model with pairwise
interactions) with a long tail (``fresh``: new ids seen once) and drift, at
two sizes; the small size again with the counts acting linearly in the
hidden model instead of through ``log1p`` (``synthetic_linear_counts``);
every profile of `ps_core.synthetic` shaped like a real log (``profile_*``:
Criteo, Avazu, rare clicks, weak signals, drift) at the small size, or
longer where its click rate needs it (`stream_size`); and
``--file PATH --format criteo|avazu|jsonl`` if given.

Needs ``pip install -e '.[quality]'``. Run: ``python bench/bench_quality.py
[--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import numpy as np
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log
from learning import LEARNERS, SLOW, add_profiles_flags, measure, streams

log = progress_log("bench_quality")


def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    data = streams(args)
    # The streams are every learner's input, made once: frozen out of the
    # cyclic collector, so that its passes over millions of fresh event
    # objects are not charged to whichever learner happens to run first.
    gc.collect()
    gc.freeze()
    for stream_name, events in data.items():
        log(f"{stream_name}: {len(events):,} events, CTR {np.mean([e['label'] for e in events]):.4f}")
        results[stream_name] = {}
        for name in args.learners:
            r = measure(name, events[: args.slow_limit] if name in SLOW else events)
            results[stream_name][name] = r
            log(
                f"  {name:9} logloss {r['logloss']:.5f}  AUC {r['auc']:.4f}  COPC {r['copc']:.3f}  "
                f"{r['events_per_s']:,.0f} events/s" + (f"  ({r['refused']:,} refused)" if r["refused"] else "")
            )
    aims: dict[str, dict[str, bool | float]] = {}
    for stream_name, r in results.items():
        best_other = min(r[n]["logloss"] for n in ("vw", "river_lr") if n in r)
        a: dict[str, bool | float] = {}
        if "ctrps_lr" in r:
            a["lr_logloss_ratio_vs_best_of_vw_river"] = r["ctrps_lr"]["logloss"] / best_other
            a["lr_logloss_le_best"] = r["ctrps_lr"]["logloss"] <= best_other
            if "river_lr" in r:
                a["lr_ratio_events_per_s_vs_river"] = r["ctrps_lr"]["events_per_s"] / r["river_lr"]["events_per_s"]
            if "vw" in r:
                a["lr_ratio_events_per_s_vs_vw"] = r["ctrps_lr"]["events_per_s"] / r["vw"]["events_per_s"]
        if "ctrps_fm" in r and "ctrps_lr" in r:
            a["fm_logloss_le_lr"] = r["ctrps_fm"]["logloss"] <= r["ctrps_lr"]["logloss"]
        if "ctrps_lr_coin" in r and "ctrps_lr" in r:
            a["lr_coin_logloss_ratio_vs_lr"] = r["ctrps_lr_coin"]["logloss"] / r["ctrps_lr"]["logloss"]
        if "ctrps_lr_ftrl" in r and "ctrps_lr" in r:
            # The mixture of learners against one of them: what it gains, what it costs.
            a["lr_logloss_ratio_vs_one_ftrl"] = r["ctrps_lr"]["logloss"] / r["ctrps_lr_ftrl"]["logloss"]
            a["lr_events_per_s_ratio_vs_one_ftrl"] = r["ctrps_lr"]["events_per_s"] / r["ctrps_lr_ftrl"]["events_per_s"]
        if "ctrps_lr_raw" in r and "ctrps_lr" in r:
            # The default numeric handling against the other: the sweep's verdict.
            a["lr_default_numeric_logloss_ratio_vs_raw"] = r["ctrps_lr"]["logloss"] / r["ctrps_lr_raw"]["logloss"]
        if "ctrps_fm_raw" in r and "ctrps_lr_raw" in r:
            a["fm_raw_logloss_le_lr_raw"] = r["ctrps_fm_raw"]["logloss"] <= r["ctrps_lr_raw"]["logloss"]
        aims[stream_name] = a
        log(f"{stream_name}: " + ", ".join(f"{k} {_shown(v)}" for k, v in a.items()))
    return {
        "mode": bench_mode(args.quick),
        "events": {k: len(v) for k, v in data.items()},
        "results": results,
        "aims": aims,
        "elapsed_s": elapsed_s(),
    }


def _shown(v: bool | float) -> str:
    return ("met" if v else "MISSED") if isinstance(v, bool) else f"{v:.3f}"


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "Progressive log loss, AUC, COPC and events/s of ctrps, Vowpal Wabbit and River on the same streams.",
        "15k and 45k events of the generator's stream, 15k of each profile (125k of rare clicks); about a minute",
        seed=7,
        record=True,
    )
    add_profiles_flags(p)
    p.add_argument("--file", type=Path, help="also a data file of your own")
    p.add_argument("--format", choices=("criteo", "avazu", "jsonl"), default="jsonl", help="its format")
    p.add_argument("--file-limit", type=int, default=0, help="read at most this many of its rows (0: all)")
    p.add_argument(
        "--learners",
        nargs="+",
        default=[n for n in LEARNERS if n not in SLOW],
        choices=list(LEARNERS),
        help=f"which to run (default all but {', '.join(SLOW)})",
    )
    p.add_argument("--slow-limit", type=int, default=20_000, help=f"events for {', '.join(SLOW)} (default 20000)")
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    print_result(main(ARGS), ARGS)
